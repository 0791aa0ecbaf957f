// CPU backend. PLACEHOLDER: a composite-ATen implementation of the contract, to be
// replaced by the fused kernel.
#include <torch/library.h>

#include "../tree_attn.h"

namespace tree_attn {
namespace {

void forward_cpu_impl(const Prepared& in, at::Tensor& out, at::Tensor& lse) {
  const auto& p = in.p;
  for (int64_t b = 0; b < p.B; ++b) {
    const int64_t off = p.has_offsets ? in.offsets[b].item<int64_t>() : 0;
    const int64_t n = off + p.M;
    auto q = in.query[b].to(at::kFloat);                                      // [Hq, T, D]
    auto k = in.key[b].narrow(1, 0, n).to(at::kFloat).repeat_interleave(p.G, 0);  // [Hq, n, D]
    auto v = in.value[b].narrow(1, 0, n).to(at::kFloat).repeat_interleave(p.G, 0);
    auto s = at::matmul(q, k.transpose(1, 2)) * p.scale;                      // [Hq, T, n]
    if (p.softcap > 0) s = at::tanh(s / p.softcap) * p.softcap;
    auto mb = in.mask.dim() == 3 ? in.mask.unsqueeze(1) : in.mask;
    mb = mb[mb.size(0) == 1 ? 0 : b].expand({p.Hq, p.T, p.M});
    auto bias = mb.scalar_type() == at::kBool
                    ? at::where(mb, 0.0f, -std::numeric_limits<float>::infinity())
                    : mb.to(at::kFloat);
    s.narrow(2, off, p.M).add_(bias);
    auto l = at::logsumexp(s, -1, true);
    auto w = at::where(at::isinf(l), at::zeros_like(s), at::exp(s - l));
    out[b].copy_(at::matmul(w, v));
    lse[b].copy_(l.squeeze(-1));
  }
}

std::tuple<at::Tensor, at::Tensor> forward_with_lse_cpu(const at::Tensor& query, const at::Tensor& key,
                                                        const at::Tensor& value, const at::Tensor& mask,
                                                        const c10::optional<at::Tensor>& mask_offset,
                                                        c10::optional<double> scale,
                                                        c10::optional<double> softcap) {
  const Prepared in = prepare(query, key, value, mask, mask_offset, scale, softcap, OffsetCheck::OnHost);
  at::Tensor out = empty_output(in), lse = empty_lse(in);
  if (!in.p.empty()) forward_cpu_impl(in, out, lse);
  return {out, lse};
}

at::Tensor forward_cpu(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                       const at::Tensor& mask, const c10::optional<at::Tensor>& mask_offset,
                       c10::optional<double> scale, c10::optional<double> softcap) {
  return std::get<0>(forward_with_lse_cpu(query, key, value, mask, mask_offset, scale, softcap));
}

}  // namespace

TORCH_LIBRARY_IMPL(tree_attn, CPU, m) {
  m.impl("forward", &forward_cpu);
  m.impl("forward_with_lse", &forward_with_lse_cpu);
}

}  // namespace tree_attn
