// The op's autograd kernel, in C++ so that an ordinary eager call (no input needing a
// gradient) costs one flag test here instead of a trip through Python.
//
// The op has no backward (it is for inference). With an input that requires grad the
// forward still runs, eager and under torch.compile (which traces a backward graph as soon
// as an input requires grad, so building the backward must not fail), and its outputs carry
// a grad_fn whose backward calls `tree_attn::_no_backward` once per input that needs a
// gradient: an op defined in Python (torch_tree_attn/_fake.py) that is traceable (its fake
// returns a tensor of the input's shape) and raises, naming the op and the input, when it
// runs.
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/autograd.h>
#include <torch/library.h>

#include <array>
#include <string>
#include <tuple>

namespace tree_attn {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// The op's positional argument names (README, "The op contract").
constexpr std::array<const char*, 8> kArgNames{"query", "key", "value", "mask", "mask_offset", "scale", "softcap",
                                               "sinks"};

using ForwardFn = at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                             const c10::optional<at::Tensor>&, c10::optional<double>, c10::optional<double>,
                             const c10::optional<at::Tensor>&);
using ForwardWithLseFn = std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                                           const at::Tensor&, const c10::optional<at::Tensor>&,
                                                           c10::optional<double>, c10::optional<double>,
                                                           const c10::optional<at::Tensor>&);

template <class Fn>
const c10::TypedOperatorHandle<Fn>& typed_op(const char* name) {
  static const auto op = c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Fn>();
  return op;
}

bool needs_grad(const at::Tensor& t) { return t.defined() && t.requires_grad(); }

bool any_needs_grad(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& mask,
                    const c10::optional<at::Tensor>& sinks) {
  return at::GradMode::is_enabled() &&
         (needs_grad(q) || needs_grad(k) || needs_grad(v) || needs_grad(mask) || (sinks && needs_grad(*sinks)));
}

// What backward needs: for each tensor argument (an autograd edge, in argument order) its
// position and shape.
void save_inputs(AutogradContext* ctx, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                 const at::Tensor& mask, const c10::optional<at::Tensor>& off,
                 const c10::optional<at::Tensor>& sinks) {
  std::vector<int64_t> positions;
  const std::array<const at::Tensor*, 8> args{&q, &k, &v, &mask, off ? &*off : nullptr, nullptr, nullptr,
                                              sinks ? &*sinks : nullptr};
  for (int pos = 0; pos < 8; ++pos) {
    if (args[pos] == nullptr || !args[pos]->defined()) continue;
    positions.push_back(pos);
    ctx->saved_data["shape" + std::to_string(pos)] = args[pos]->sizes().vec();
  }
  ctx->saved_data["positions"] = positions;
}

// grad_fn of the op's outputs: one `_no_backward` call per input that needs a gradient.
variable_list no_backward(AutogradContext* ctx, const variable_list& grads, const char* op) {
  at::Tensor grad;
  for (const auto& g : grads)
    if (g.defined()) {
      grad = g;
      break;
    }
  static const c10::OperatorHandle handle =
      c10::Dispatcher::singleton().findSchemaOrThrow("tree_attn::_no_backward", "");
  variable_list out(kArgNames.size());
  const auto positions = ctx->saved_data["positions"].toIntVector();
  for (size_t edge = 0; edge < positions.size(); ++edge) {
    const int64_t pos = positions[edge];
    if (!ctx->needs_input_grad(edge)) continue;
    torch::jit::Stack stack{grad, ctx->saved_data["shape" + std::to_string(pos)].toIntVector(), std::string(op),
                            std::string(kArgNames[pos])};
    handle.callBoxed(&stack);
    out[pos] = stack.at(0).toTensor();
  }
  return out;
}

struct ForwardNoBackward : torch::autograd::Function<ForwardNoBackward> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                            const at::Tensor& mask, const c10::optional<at::Tensor>& off, c10::optional<double> scale,
                            c10::optional<double> softcap, const c10::optional<at::Tensor>& sinks) {
    save_inputs(ctx, q, k, v, mask, off, sinks);
    at::AutoDispatchBelowADInplaceOrView below;
    return typed_op<ForwardFn>("tree_attn::forward").call(q, k, v, mask, off, scale, softcap, sinks);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    return no_backward(ctx, grads, "tree_attn.forward");
  }
};

struct ForwardWithLseNoBackward : torch::autograd::Function<ForwardWithLseNoBackward> {
  static variable_list forward(AutogradContext* ctx, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                               const at::Tensor& mask, const c10::optional<at::Tensor>& off,
                               c10::optional<double> scale, c10::optional<double> softcap,
                               const c10::optional<at::Tensor>& sinks) {
    save_inputs(ctx, q, k, v, mask, off, sinks);
    at::AutoDispatchBelowADInplaceOrView below;
    auto [out, lse] =
        typed_op<ForwardWithLseFn>("tree_attn::forward_with_lse").call(q, k, v, mask, off, scale, softcap, sinks);
    return {out, lse};
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    return no_backward(ctx, grads, "tree_attn.forward_with_lse");
  }
};

// The Autograd kernels: straight below autograd when nothing needs a gradient.
at::Tensor forward_autograd(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& mask,
                            const c10::optional<at::Tensor>& off, c10::optional<double> scale,
                            c10::optional<double> softcap, const c10::optional<at::Tensor>& sinks) {
  if (any_needs_grad(q, k, v, mask, sinks)) return ForwardNoBackward::apply(q, k, v, mask, off, scale, softcap, sinks);
  at::AutoDispatchBelowADInplaceOrView below;
  return typed_op<ForwardFn>("tree_attn::forward").call(q, k, v, mask, off, scale, softcap, sinks);
}

std::tuple<at::Tensor, at::Tensor> forward_with_lse_autograd(const at::Tensor& q, const at::Tensor& k,
                                                             const at::Tensor& v, const at::Tensor& mask,
                                                             const c10::optional<at::Tensor>& off,
                                                             c10::optional<double> scale,
                                                             c10::optional<double> softcap,
                                                             const c10::optional<at::Tensor>& sinks) {
  if (any_needs_grad(q, k, v, mask, sinks)) {
    auto outs = ForwardWithLseNoBackward::apply(q, k, v, mask, off, scale, softcap, sinks);
    return {outs[0], outs[1]};
  }
  at::AutoDispatchBelowADInplaceOrView below;
  return typed_op<ForwardWithLseFn>("tree_attn::forward_with_lse").call(q, k, v, mask, off, scale, softcap, sinks);
}

}  // namespace
}  // namespace tree_attn

TORCH_LIBRARY_IMPL(tree_attn, Autograd, m) {
  m.impl("forward", &tree_attn::forward_autograd);
  m.impl("forward_with_lse", &tree_attn::forward_with_lse_autograd);
}
