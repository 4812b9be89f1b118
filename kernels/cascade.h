// Cascade attention's plan (FlashInfer's name for it): in a Decode batch, forks of one prompt
// (ForkCache's caches hold their source's pages) read the keys of the pages they share once for
// all their rows, then each its own. The two rules both backends' decode planners use: which
// leading keys every row of a problem sees, so that a shared chunk's tiles are the ones the
// problem's own run would take; and how many leading tokens two problems' caches hold in the
// same pages. Host code only.
#pragma once

#include <algorithm>
#include <cstdint>
#include <map>
#include <vector>

#include "kernels/geometry.h"
#include "kernels/problem.h"

namespace attn {

// The leading keys [0, n) that every query row of `p` sees (its visible range starts at key 0
// and ends at n or later): n, or 0 when `p` reads no cache's pages, is a batch, is ragged or has
// a token tree.
inline int64_t KeysEveryRowSees(const Problem& p) {
  if (p.pages == nullptr || p.shape.batch != 1 || p.tree_count > 0) return 0;
  const Geometry geometry = p.geometry();
  if (geometry.sequences > 0) return 0;
  int64_t end = p.shape.key_len;
  for (int64_t q = 0; q < p.shape.query_len; ++q) {
    const KeyRange visible = geometry.Visible(q);
    if (visible.begin != 0) return 0;
    end = std::min(end, visible.end);
  }
  return end;
}

// Leading tokens of two problems' caches in the same pages (whole pages of both, compared
// through the host's copies of the tables): 0 unless their layouts and shapes agree.
inline int64_t SharedTokens(const Problem& a, const Problem& b) {
  if (a.pages == nullptr || b.pages == nullptr) return 0;
  const PagedKv &x = *a.pages, &y = *b.pages;
  if (x.page_tokens != y.page_tokens || x.dtype != y.dtype || x.key_width != y.key_width ||
      x.value_width != y.value_width || a.shape.kv_heads != b.shape.kv_heads ||
      a.shape.head_dim != b.shape.head_dim || a.shape.value_dim != b.shape.value_dim ||
      x.host_key_pages == nullptr || y.host_key_pages == nullptr) {
    return 0;
  }
  const int64_t pages = std::min(a.shape.key_len, b.shape.key_len) / x.page_tokens;
  int64_t same = 0;
  while (same < pages && x.host_key_pages[same] == y.host_key_pages[same] &&
         x.host_value_pages[same] == y.host_value_pages[same]) {
    ++same;
  }
  return same * x.page_tokens;
}

// One cascade of a batch: its members (indices into the batch, in batch order; two or more), the
// leading chunks they run together, and their rows (per kv head).
struct CascadeGroup {
  std::vector<size_t> members;
  int64_t chunks = 0, rows = 0;
};

// The batch's cascades: problems grouped by their cache's first page, each group's shared chunks
// the fewest any member shares with its first (members sharing none left out), at most max_rows
// rows a cascade. Problem i may run its first cascadable[i] chunks of chunk_tokens[i] keys in a
// cascade (0: none; at most KeysEveryRowSees / chunk_tokens) and has rows[i] rows per kv head.
inline std::vector<CascadeGroup> PlanCascades(const std::vector<const Problem*>& problems,
                                              const std::vector<int64_t>& cascadable,
                                              const std::vector<int64_t>& chunk_tokens,
                                              const std::vector<int64_t>& rows, int64_t max_rows) {
  std::map<const void*, std::vector<size_t>> by_first_page;
  for (size_t i = 0; i < problems.size(); ++i) {
    if (cascadable[i] > 0 && problems[i]->pages->host_key_pages != nullptr) {
      by_first_page[problems[i]->pages->host_key_pages[0]].push_back(i);
    }
  }
  std::vector<CascadeGroup> cascades;
  for (const auto& [page, members] : by_first_page) {
    CascadeGroup cascade;
    auto close = [&] {
      if (cascade.members.size() >= 2) cascades.push_back(cascade);
      cascade = CascadeGroup{};
    };
    for (size_t i : members) {
      if (!cascade.members.empty() && cascade.rows + rows[i] > max_rows) close();
      const int64_t chunks =
          cascade.members.empty()
              ? cascadable[i]
              : std::min(cascadable[i], SharedTokens(*problems[cascade.members[0]], *problems[i]) /
                                            chunk_tokens[i]);
      if (chunks == 0) continue;
      cascade.chunks = cascade.members.empty() ? chunks : std::min(cascade.chunks, chunks);
      cascade.members.push_back(i);
      cascade.rows += rows[i];
    }
    close();
  }
  return cascades;
}

}  // namespace attn
