// kernels/cpu/blas_core.h: the table of OpenBLAS core names, the core type chosen for each
// instruction-set level, and SelectBlasCore's branches that do not run the program again (the
// one that does is checked end to end by tests/cli_test.sh, on attnd's start-up banner).
#include "kernels/cpu/blas_core.h"

#include <cblas.h>
#include <stdlib.h>

#include <string>

#include "gtest/gtest.h"

namespace {

using attn::IsaLevel;

TEST(BlasCoreTest, CoreNamesHaveTheirInstructionSets) {
  EXPECT_EQ(attn::LevelOfBlasCore("Prescott"), IsaLevel::kSse);
  EXPECT_EQ(attn::LevelOfBlasCore("Nehalem"), IsaLevel::kSse);
  EXPECT_EQ(attn::LevelOfBlasCore("Sandybridge"), IsaLevel::kAvx);
  EXPECT_EQ(attn::LevelOfBlasCore("Haswell"), IsaLevel::kAvx2);
  EXPECT_EQ(attn::LevelOfBlasCore("zen"), IsaLevel::kAvx2);  // Case does not matter.
  EXPECT_EQ(attn::LevelOfBlasCore("SkylakeX"), IsaLevel::kAvx512);
  EXPECT_EQ(attn::LevelOfBlasCore("COOPERLAKE"), IsaLevel::kAvx512);
  EXPECT_EQ(attn::LevelOfBlasCore("Skylake"), std::nullopt);  // Not a name it knows: no guess.
  EXPECT_EQ(attn::LevelOfBlasCore(""), std::nullopt);
}

TEST(BlasCoreTest, EachLevelHasTheBestCoreTypeForIt) {
  EXPECT_EQ(attn::BlasCoreTypeFor(IsaLevel::kAvx512), "SKYLAKEX");
  EXPECT_EQ(attn::BlasCoreTypeFor(IsaLevel::kAvx2), "HASWELL");
  EXPECT_EQ(attn::BlasCoreTypeFor(IsaLevel::kAvx), "SANDYBRIDGE");
  EXPECT_EQ(attn::BlasCoreTypeFor(IsaLevel::kSse), std::nullopt);
}

// Whatever core this process's OpenBLAS runs, the name is one the table knows, so that the
// comparison with the CPU's level means something on this machine.
TEST(BlasCoreTest, TheLibrarysCoreIsInTheTable) {
  const std::string core = openblas_get_corename();
  EXPECT_NE(attn::LevelOfBlasCore(core), std::nullopt) << core;
}

TEST(BlasCoreTest, AChoiceTheUserMadeIsKept) {
  char name[] = "blas_core_test";
  char* argv[] = {name, nullptr};
  setenv("OPENBLAS_CORETYPE", "HASWELL", 1);  // Read by the library at load only: a label here.
  EXPECT_NE(attn::SelectBlasCore(argv).find("OPENBLAS_CORETYPE=HASWELL, as given"),
            std::string::npos);
  unsetenv("OPENBLAS_CORETYPE");
  setenv("ATTN_BLAS_CORE", "keep", 1);
  EXPECT_NE(attn::SelectBlasCore(argv).find("ATTN_BLAS_CORE=keep"), std::string::npos);
  unsetenv("ATTN_BLAS_CORE");
}

}  // namespace
