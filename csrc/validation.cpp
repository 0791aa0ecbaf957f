// The op contract, checked once for every backend. Every failure names the argument
// and the values seen; Python sees ValueError (shapes, values) or TypeError (dtypes).
#include "tree_attn.h"

#include <c10/util/safe_numerics.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <sstream>
#include <vector>

namespace tree_attn {
namespace {

std::string shape_of(c10::IntArrayRef sizes) {
  std::ostringstream s;
  s << sizes;
  return s.str();
}

bool supported_head_dim(int64_t d) { return d == 64 || d == 96 || d == 128 || d == 256 || d == 512; }

bool attention_dtype(at::ScalarType t) {
  return t == at::kFloat || t == at::kHalf || t == at::kBFloat16;
}

// key and value share one attention dtype; query has it too, or is float32 over half K/V.
bool supported_dtypes(at::ScalarType q, at::ScalarType k, at::ScalarType v) {
  return k == v && attention_dtype(k) && (q == k || q == at::kFloat);
}

// The largest element index a strided view can touch, overflow-checked, so kernels may
// index with plain int64 arithmetic.
void check_index_range(const ArgInfo& t, const char* name) {
  int64_t extent = 0;
  for (size_t d = 0; d < t.sizes.size(); ++d) {
    if (t.sizes[d] == 0) return;
    int64_t span = 0;
    bool overflow = c10::mul_overflows(t.sizes[d] - 1, std::abs(t.strides[d]), &span);
    overflow = overflow || c10::add_overflows(extent, span, &extent);
    TORCH_CHECK_VALUE(!overflow, name, ": strides ", t.strides, " with shape ", t.sizes,
                      " overflow 64-bit element indexing");
  }
  int64_t bytes = 0;
  TORCH_CHECK_VALUE(!c10::mul_overflows(extent + 1, int64_t(c10::elementSize(t.dtype)), &bytes), name,
                    ": shape ", t.sizes, " is too large to address");
}

at::Tensor unit_inner_stride(const at::Tensor& t) {
  return (t.size(-1) <= 1 || t.stride(-1) == 1) ? t : t.contiguous();
}

}  // namespace

ArgInfo ArgInfo::of(const at::Tensor& t) { return ArgInfo{t.sizes(), t.strides(), t.scalar_type(), t.device()}; }

Problem check_contract(const ArgInfo& query, const ArgInfo& key, const ArgInfo& value, const ArgInfo& mask,
                       const ArgInfo* mask_offset, c10::optional<double> scale, c10::optional<double> softcap,
                       const ArgInfo* sinks) {
  // Ranks first: everything after indexes sizes.
  TORCH_CHECK_VALUE(query.dim() == 4, "query must be 4-D [B, Hq, T, D], got shape ", shape_of(query.sizes));
  TORCH_CHECK_VALUE(key.dim() == 4, "key must be 4-D [B, Hkv, S, D], got shape ", shape_of(key.sizes));
  TORCH_CHECK_VALUE(value.dim() == 4, "value must be 4-D [B, Hkv, S, D], got shape ", shape_of(value.sizes));
  TORCH_CHECK_VALUE(mask.dim() == 3 || mask.dim() == 4,
                    "mask must be 3-D [B or 1, T, M] or 4-D [B or 1, 1 or Hq, T, M], got shape ",
                    shape_of(mask.sizes));

  const auto device = query.device;
  TORCH_CHECK_VALUE(key.device == device && value.device == device && mask.device == device,
                    "query, key, value and mask must be on one device, got query on ", device,
                    ", key on ", key.device, ", value on ", value.device, ", mask on ", mask.device);

  TORCH_CHECK_TYPE(supported_dtypes(query.dtype, key.dtype, value.dtype),
                   "query, key and value dtypes must be one of float32, float16 or bfloat16 for all three, "
                   "or a float32 query over float16 or bfloat16 key and value; got query ",
                   query.dtype, ", key ", key.dtype, ", value ", value.dtype);

  Problem p;
  p.B = query.sizes[0];
  p.Hq = query.sizes[1];
  p.T = query.sizes[2];
  p.D = query.sizes[3];
  p.Hkv = key.sizes[1];
  p.S = key.sizes[2];
  p.q_dtype = query.dtype;
  p.kv_dtype = key.dtype;

  TORCH_CHECK_VALUE(supported_head_dim(p.D), "query head dim D must be one of 64, 96, 128, 256, 512, got ",
                    p.D, " (query shape ", shape_of(query.sizes), ")");
  TORCH_CHECK_VALUE(key.sizes[0] == p.B && key.sizes[3] == p.D,
                    "key must be [B, Hkv, S, D] = [", p.B, ", Hkv, S, ", p.D, "] to match query ",
                    shape_of(query.sizes), ", got ", shape_of(key.sizes));
  TORCH_CHECK_VALUE(value.sizes == key.sizes, "value shape must equal key shape ", shape_of(key.sizes),
                    ", got ", shape_of(value.sizes));
  // No heads is no call: reject it (B = 0 or T = 0 stays an empty call with empty outputs).
  TORCH_CHECK_VALUE(p.Hq > 0, "query must have at least one head (Hq >= 1 in [B, Hq, T, D]), got shape ",
                    shape_of(query.sizes));
  TORCH_CHECK_VALUE(p.Hkv > 0 && p.Hq % p.Hkv == 0,
                    "query heads Hq must be a positive multiple of key/value heads Hkv, got Hq=", p.Hq,
                    " Hkv=", p.Hkv, " (query shape ", shape_of(query.sizes), ", key shape ", shape_of(key.sizes), ")");
  p.G = p.Hq / p.Hkv;

  // Mask: [B|1, T, M] or [B|1, 1|Hq, T, M], bool or floating.
  TORCH_CHECK_TYPE(mask.dtype == at::kBool || at::isFloatingType(mask.dtype),
                   "mask must be bool (True = attend) or floating (additive bias), got ", mask.dtype);
  const bool mask4 = mask.dim() == 4;
  const int64_t mB = mask.sizes[0], mH = mask4 ? mask.sizes[1] : 1;
  const int64_t mT = mask.sizes[mask.dim() - 2];
  p.M = mask.sizes[mask.dim() - 1];
  TORCH_CHECK_VALUE(mB == p.B || mB == 1, "mask batch size must be B=", p.B, " or 1, got mask shape ",
                    shape_of(mask.sizes));
  TORCH_CHECK_VALUE(mH == 1 || mH == p.Hq, "mask head size must be 1 or Hq=", p.Hq,
                    ", got mask shape ", shape_of(mask.sizes));
  TORCH_CHECK_VALUE(mT == p.T, "mask query size must be T=", p.T, ", got mask shape ", shape_of(mask.sizes));
  TORCH_CHECK_VALUE(p.M <= p.S, "mask window M=", p.M, " exceeds key capacity S=", p.S,
                    " (mask shape ", shape_of(mask.sizes), ", key shape ", shape_of(key.sizes), ")");
  p.mask_kind = mask.dtype == at::kBool ? MaskKind::Bool : MaskKind::Additive;

  check_index_range(query, "query");
  check_index_range(key, "key");
  check_index_range(value, "value");
  check_index_range(mask, "mask");
  uint64_t out_elems = 0;
  TORCH_CHECK_VALUE(!c10::safe_multiplies_u64(query.sizes, &out_elems) &&
                        out_elems <= uint64_t(std::numeric_limits<int64_t>::max() / 4),
                    "output of shape ", shape_of(query.sizes), " is too large");

  if (mask_offset != nullptr) {
    const ArgInfo& off = *mask_offset;
    TORCH_CHECK_TYPE(off.dtype == at::kInt || off.dtype == at::kLong,
                     "mask_offset must be int32 or int64, got ", off.dtype);
    TORCH_CHECK_VALUE(off.dim() == 1 && off.sizes[0] == p.B, "mask_offset must have shape [B] = [", p.B,
                      "], got ", shape_of(off.sizes));
    TORCH_CHECK_VALUE(off.device == device, "mask_offset must be on the query's device ", device,
                      ", got ", off.device);
    p.has_mask_offset = true;
  }

  if (sinks != nullptr) {
    const ArgInfo& sk = *sinks;
    TORCH_CHECK_TYPE(at::isFloatingType(sk.dtype), "sinks must be a floating tensor (one logit per query head), got ",
                     sk.dtype);
    TORCH_CHECK_VALUE(sk.dim() == 1 && sk.sizes[0] == p.Hq, "sinks must have shape [Hq] = [", p.Hq, "], got ",
                      shape_of(sk.sizes));
    TORCH_CHECK_VALUE(sk.device == device, "sinks must be on the query's device ", device, ", got ", sk.device);
    check_index_range(sk, "sinks");
    p.has_sinks = true;
  }

  // scale and softcap are float32 in every kernel: check the values the kernels will use.
  const double default_scale = 1.0 / std::sqrt(double(p.D));
  const double s = scale.has_value() ? *scale : default_scale;
  TORCH_CHECK_VALUE(std::isfinite(s) && std::isfinite(float(s)), "scale must be a finite float32, got ", s);
  TORCH_CHECK_VALUE(s == 0 || float(s) != 0.0f, "scale ", s, " rounds to 0 in float32");
  p.scale = float(s);
  if (softcap.has_value()) {
    const double c = *softcap;
    TORCH_CHECK_VALUE(std::isfinite(c) && c > 0 && std::isfinite(float(c)) && float(c) > 0.0f,
                      "softcap must be a positive finite float32 (None turns it off), got ", c);
    p.softcap = float(c);
  }
  return p;
}

Prepared prepare(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                 const at::Tensor& mask, const c10::optional<at::Tensor>& mask_offset,
                 c10::optional<double> scale, c10::optional<double> softcap,
                 const c10::optional<at::Tensor>& sinks, OffsetCheck offset_check) {
  const ArgInfo off_info = mask_offset.has_value() ? ArgInfo::of(*mask_offset) : ArgInfo{};
  const ArgInfo sink_info = sinks.has_value() ? ArgInfo::of(*sinks) : ArgInfo{};
  Problem p = check_contract(ArgInfo::of(query), ArgInfo::of(key), ArgInfo::of(value), ArgInfo::of(mask),
                             mask_offset.has_value() ? &off_info : nullptr, scale, softcap,
                             sinks.has_value() ? &sink_info : nullptr);

  Prepared out;
  out.query = unit_inner_stride(query);
  out.key = unit_inner_stride(key);
  out.value = unit_inner_stride(value);
  const auto mdt = mask.scalar_type();
  out.mask = (mdt == at::kBool || mdt == at::kFloat) ? mask : mask.to(at::kFloat);
  for (int i = 0; i < 4; ++i) {
    p.q_stride[i] = out.query.size(i) == 1 ? 0 : out.query.stride(i);
    p.k_stride[i] = out.key.size(i) == 1 ? 0 : out.key.stride(i);
    p.v_stride[i] = out.value.size(i) == 1 ? 0 : out.value.stride(i);
  }
  p.q_stride[3] = p.k_stride[3] = p.v_stride[3] = 1;
  const auto& m = out.mask;
  const bool mask4 = m.dim() == 4;
  const int dims[4] = {0, mask4 ? 1 : -1, int(m.dim()) - 2, int(m.dim()) - 1};
  for (int i = 0; i < 4; ++i)
    p.mask_stride[i] = (dims[i] < 0 || m.size(dims[i]) == 1) ? 0 : m.stride(dims[i]);

  if (mask_offset.has_value()) {
    const auto& off = *mask_offset;
    if (offset_check == OffsetCheck::OnHost && p.B > 0) {
      const auto off64 = off.to(at::kLong).contiguous();
      const std::vector<int64_t> seen(off64.data_ptr<int64_t>(), off64.data_ptr<int64_t>() + p.B);
      const int64_t lo = *std::min_element(seen.begin(), seen.end());
      const int64_t hi = *std::max_element(seen.begin(), seen.end());
      TORCH_CHECK_VALUE(lo >= 0, "mask_offset values must be >= 0, got min ", lo, " in ", c10::IntArrayRef(seen));
      TORCH_CHECK_VALUE(hi <= p.S - p.M, "mask_offset + M must be <= S=", p.S, " for M=", p.M,
                        ", got max offset ", hi, " (offsets ", c10::IntArrayRef(seen), ")");
    }
    // int32 is exact here: on the host path offsets are <= S; on the clamping path any
    // value is clamped to [0, S] before it is read, so saturate instead of wrapping.
    out.mask_offset = (off.scalar_type() == at::kInt || offset_check == OffsetCheck::ClampInKernelAnyInt)
                      ? off.contiguous()
                      : off.clamp(0, std::numeric_limits<int32_t>::max()).to(at::kInt).contiguous();
  }
  // Sinks are read as float32 (a float64 sink beyond float32's range becomes inf).
  if (sinks.has_value()) out.sinks = sinks->to(at::kFloat).contiguous();
  out.p = p;
  return out;
}

at::Tensor empty_output(const Prepared& in) {
  const auto& p = in.p;
  return at::empty({p.B, p.Hq, p.T, p.D}, in.query.options().memory_format(at::MemoryFormat::Contiguous));
}

at::Tensor empty_lse(const Prepared& in) {
  const auto& p = in.p;
  return at::empty({p.B, p.Hq, p.T}, in.query.options().dtype(at::kFloat));
}

}  // namespace tree_attn
