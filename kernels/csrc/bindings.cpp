// Python bindings of Strata's CPU kernels (one extension module built from every file in csrc/).

#include <torch/extension.h>

void paged_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache, at::Tensor out,
                     at::Tensor lse, const at::Tensor& query_start, const at::Tensor& seq_lens,
                     const at::Tensor& kv_offsets, const at::Tensor& block_tables, const at::Tensor& seqs,
                     double scale, int64_t window);
at::Tensor small_linear(const at::Tensor& x, const at::Tensor& w, const at::Tensor& bias);
void apply_token_bitmask(at::Tensor logits, const at::Tensor& bitmask, const at::Tensor& rows);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_attention", &paged_attention, "paged attention over the block-major KV pool (CPU)");
  m.def("small_linear", &small_linear, "x W^T + b for a few rows of x, streaming W (CPU)");
  m.def("apply_token_bitmask", &apply_token_bitmask, "-inf where a grammar's bitmask disallows a token (CPU, in place)");
}
