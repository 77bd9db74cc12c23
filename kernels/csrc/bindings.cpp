// Python bindings of Strata's CPU kernels (one extension module built from every file in csrc/).

#include <torch/extension.h>

void paged_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache, at::Tensor out,
                     at::Tensor lse, const at::Tensor& query_start, const at::Tensor& seq_lens,
                     const at::Tensor& kv_offsets, const at::Tensor& block_tables, const at::Tensor& seqs,
                     double scale, int64_t window);
at::Tensor small_linear(const at::Tensor& x, const at::Tensor& w, const at::Tensor& bias);
bool amx_bf16_available();
at::Tensor amx_bf16_linear(const at::Tensor& x, const at::Tensor& w, const at::Tensor& bias);
at::Tensor fp8_block_linear(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scale,
                            const at::Tensor& row_block, int64_t block_rows, int64_t block_cols,
                            const at::Tensor& bias);
at::Tensor int4_group_linear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scale,
                             const at::Tensor& zero, int64_t group, const at::Tensor& bias);
at::Tensor mxfp4_linear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scale, const at::Tensor& bias);
at::Tensor ggml_block_linear(const at::Tensor& x, const at::Tensor& data, int64_t kind, const at::Tensor& bias);
at::Tensor fp8_block_dequant(const at::Tensor& codes, const at::Tensor& scale, const at::Tensor& row_block,
                             int64_t block_rows, int64_t block_cols, int64_t r0, int64_t r1);
at::Tensor int4_group_dequant(const at::Tensor& packed, const at::Tensor& scale, const at::Tensor& zero, int64_t group,
                              int64_t k, int64_t r0, int64_t r1);
at::Tensor mxfp4_dequant(const at::Tensor& packed, const at::Tensor& scale, int64_t r0, int64_t r1);
at::Tensor dense_gemm_linear(const at::Tensor& x, const at::Tensor& w, const at::Tensor& bias);
at::Tensor ggml_block_dequant(const at::Tensor& data, int64_t kind, int64_t k, int64_t r0, int64_t r1);
void apply_token_bitmask(at::Tensor logits, const at::Tensor& bitmask, const at::Tensor& rows);
at::Tensor rms_norm_bf16(const at::Tensor& x, const at::Tensor& w, double eps);
at::Tensor rope_bf16(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin_signed);
at::Tensor silu_mul_bf16(const at::Tensor& gate_up);
at::Tensor delta_rule_step(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& g,
                           const at::Tensor& beta, at::Tensor pool, const at::Tensor& read, const at::Tensor& write);
at::Tensor index_scores(const at::Tensor& q, const at::Tensor& keys, const at::Tensor& weights, double scale);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("index_scores", &index_scores,
        "DSA indexer scores: ReLU'd, head-weighted dot products of query rows with every key, fused (CPU)");
  m.def("delta_rule_step", &delta_rule_step,
        "one gated-delta-rule decode step per sequence, state read from one pool slot and written to another (CPU)");
  m.def("paged_attention", &paged_attention, "paged attention over the block-major KV pool (CPU)");
  m.def("small_linear", &small_linear, "x W^T + b for a few rows of x, streaming W (CPU)");
  m.def("amx_bf16_available", &amx_bf16_available, "whether AMX bf16 tiles can run here (asks Linux once)");
  m.def("amx_bf16_linear", &amx_bf16_linear, "x W^T + b for bf16 x and W on AMX tiles, W streamed once per 32 rows (CPU)");
  m.def("fp8_block_linear", &fp8_block_linear, "x W^T + b for a few rows of x, streaming FP8-block W (CPU)");
  m.def("int4_group_linear", &int4_group_linear, "x W^T + b for a few rows of x, streaming INT4-group W (CPU)");
  m.def("mxfp4_linear", &mxfp4_linear, "x W^T + b for a few rows of x, streaming MXFP4 W (CPU)");
  m.def("ggml_block_linear", &ggml_block_linear, "x W^T + b for a few rows of x, streaming GGUF q4_0/q4_1/q8_0 W (CPU)");
  m.def("dense_gemm_linear", &dense_gemm_linear, "x W^T + b for a dense fp32/bf16 W, W a few rows at a time in cache (CPU)");
  m.def("fp8_block_dequant", &fp8_block_dequant, "rows of an FP8-block weight as fp32 (CPU)");
  m.def("int4_group_dequant", &int4_group_dequant, "rows of an INT4-group weight as fp32 (CPU)");
  m.def("mxfp4_dequant", &mxfp4_dequant, "rows of an MXFP4 weight as fp32 (CPU)");
  m.def("ggml_block_dequant", &ggml_block_dequant, "rows of a GGUF q4_0/q4_1/q8_0 weight as fp32 (CPU)");
  m.def("rms_norm_bf16", &rms_norm_bf16, "RMSNorm of bf16 rows in one pass, rounding where the eager ops do (CPU)");
  m.def("rope_bf16", &rope_bf16, "rotate-half RoPE of bf16 heads in one pass, bit-identical to the eager ops (CPU)");
  m.def("silu_mul_bf16", &silu_mul_bf16, "silu(gate) * up of a fused bf16 gate/up projection in one pass (CPU)");
  m.def("apply_token_bitmask", &apply_token_bitmask, "-inf where a grammar's bitmask disallows a token (CPU, in place)");
}
