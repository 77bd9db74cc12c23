// Structured output's mask on the logits: for each constrained row, every token its grammar disallows
// becomes -inf, in place.
//
// The grammar engine (llguidance) writes one bit per token, 32 tokens to an int32 word. Unpacking those
// bits into a boolean tensor and masking with it takes six passes over the rows' logits in eager torch
// (9 ms for 32 rows of a 49K vocabulary here); this is one pass: a word of all ones leaves its 32 logits
// alone, a word of zeros is a run of -inf, and only mixed words are read bit by bit. Tokens past the
// mask's words (a logits row wider than the grammar's vocabulary) are disallowed.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/extension.h>

#include <cstdint>
#include <limits>

namespace {

template <typename T>
void mask_row(T* row, const int32_t* words, int64_t num_words, int64_t vocab) {
  const T blocked = static_cast<T>(-std::numeric_limits<float>::infinity());
  for (int64_t w = 0; w < num_words; ++w) {
    const int64_t base = w * 32;
    if (base >= vocab) return;
    const uint32_t word = static_cast<uint32_t>(words[w]);
    if (word == 0xFFFFFFFFu) continue;
    const int64_t n = vocab - base < 32 ? vocab - base : 32;
    if (word == 0) {
      for (int64_t b = 0; b < n; ++b) row[base + b] = blocked;
      continue;
    }
    for (int64_t b = 0; b < n; ++b) {
      if (!((word >> b) & 1u)) row[base + b] = blocked;
    }
  }
  for (int64_t t = num_words * 32; t < vocab; ++t) row[t] = blocked;
}

template <typename T>
void mask_rows(at::Tensor& logits, const at::Tensor& bitmask, const at::Tensor& rows) {
  T* out = logits.data_ptr<T>();
  const int32_t* words = bitmask.data_ptr<int32_t>();
  const int64_t* which = rows.data_ptr<int64_t>();
  const int64_t vocab = logits.size(1), num_words = bitmask.size(1);
  at::parallel_for(0, rows.size(0), 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) mask_row(out + which[r] * vocab, words + r * num_words, num_words, vocab);
  });
}

}  // namespace

void apply_token_bitmask(at::Tensor logits, const at::Tensor& bitmask, const at::Tensor& rows) {
  TORCH_CHECK(logits.device().is_cpu() && logits.dim() == 2 && logits.is_contiguous(), "logits: contiguous 2-D CPU");
  TORCH_CHECK(bitmask.scalar_type() == at::kInt && bitmask.dim() == 2 && bitmask.is_contiguous(), "bitmask: int32 2-D");
  TORCH_CHECK(rows.scalar_type() == at::kLong && rows.dim() == 1 && rows.size(0) == bitmask.size(0), "rows: one per mask row");
  TORCH_CHECK(rows.numel() == 0 || (rows.min().item<int64_t>() >= 0 && rows.max().item<int64_t>() < logits.size(0)),
              "rows: indices of logits rows");
  switch (logits.scalar_type()) {
    case at::kFloat: mask_rows<float>(logits, bitmask, rows); break;
    case at::kBFloat16: mask_rows<at::BFloat16>(logits, bitmask, rows); break;
    case at::kHalf: mask_rows<at::Half>(logits, bitmask, rows); break;
    default: TORCH_CHECK(false, "logits: float32, bfloat16 or float16");
  }
}
