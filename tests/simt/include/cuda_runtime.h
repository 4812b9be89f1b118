// The SIMT emulator's stand-in for the CUDA Toolkit's cuda_runtime.h (tests/simt/README.md): the
// host runtime (host_api.h) and what device code sees (device.h).
#pragma once

#include "tests/simt/device.h"
#include "tests/simt/host_api.h"
