// The Metal backend's launch plan, executed by the CPU simulator of the Metal shaders.
//
// `_metal_sim_forward(_with_lse)` run on CPU tensors exactly what the MPS backend encodes:
// the same plan (csrc/plan.h), the same shader source, the same buffer byte offsets, with
// offsets clamped in the kernel rather than checked on the host. Each launch's counted
// device bytes must equal the plan's traffic model, or the call fails.
//
// Debug ops for tests and reports (CPU tensors, same arguments as forward):
//   _launch_plan -> str        the plan and its traffic model as JSON
//   _metal_sim_traffic -> str  counted vs modelled bytes of each launch, as JSON
// (`_metal_sim_kernels`, the simulator's kernel list, is in sim_ops.cpp.)
#include <torch/library.h>

#include <limits>
#include <sstream>

#include "../plan.h"
#include "../tree_attn.h"
#include "runtime.h"

namespace tree_attn {
namespace {

#define TREE_ATTN_ARGS_DECL                                                                           \
  const at::Tensor &query, const at::Tensor &key, const at::Tensor &value, const at::Tensor &mask, \
      const c10::optional<at::Tensor>&mask_offset, c10::optional<double> scale,                     \
      c10::optional<double> softcap

struct SimCall {
  Prepared in;
  Plan plan;
  std::vector<Visibility> vis;
};

SimCall prepare_sim_call(TREE_ATTN_ARGS_DECL) {
  SimCall call;
  call.in = prepare(query, key, value, mask, mask_offset, scale, softcap, OffsetCheck::ClampInKernel);
  TORCH_CHECK_VALUE(call.in.query.device().is_cpu(),
                    "the Metal simulator runs on CPU tensors, got query on ", call.in.query.device());
  call.plan = make_plan(call.in);
  std::vector<int64_t> offsets;
  if (call.in.p.has_offsets) {
    const int32_t* raw = call.in.offsets.data_ptr<int32_t>();
    offsets.assign(raw, raw + call.in.p.B);
  }
  call.vis = visibility_from_offsets(call.in.p, offsets);
  return call;
}

sim::Binding tensor_binding(const at::Tensor& t, const BufferBinding& b) {
  sim::Binding out;
  const auto& storage = t.storage();
  out.base = storage.data();
  out.length = storage.nbytes();
  out.offset = b.byte_offset;
  out.writable = b.writable;
  out.name = role_name(b.role);
  return out;
}

struct LaunchRecord {
  std::string kernel;
  sim::LaunchStats counted;
  uint64_t modelled_read = 0, modelled_written = 0;
};

// Runs every launch of the plan; returns what each read and wrote, counted and modelled.
std::vector<LaunchRecord> run_plan(const SimCall& call, at::Tensor& out, at::Tensor& lse) {
  const Prepared& in = call.in;
  const Plan& plan = call.plan;
  // Scratch, out and lse start as NaN: a kernel that reads a partial nobody wrote, or
  // leaves an output element unwritten, shows up in the result.
  at::Tensor scratch = at::full({int64_t(plan.scratch_bytes / sizeof(float))},
                                std::numeric_limits<float>::quiet_NaN(), in.query.options().dtype(at::kFloat));
  out.fill_(std::numeric_limits<double>::quiet_NaN());
  lse.fill_(std::numeric_limits<double>::quiet_NaN());

  const uint64_t skipped = count_skipped_keys(in, plan, call.vis);
  std::vector<LaunchRecord> records;
  for (size_t i = 0; i < plan.launches.size(); ++i) {
    const Launch& launch = plan.launches[i];
    sim::LaunchDesc desc;
    desc.kernel = launch.kernel;
    desc.grid = launch.grid;
    desc.threads = launch.threads;
    if (launch.threadgroup_memory_bytes) desc.threadgroup_memory[0] = launch.threadgroup_memory_bytes;
    for (const BufferBinding& b : launch.buffers) {
      sim::Binding binding;
      switch (b.role) {
        case BufferRole::Params: {
          const auto* bytes = reinterpret_cast<const uint8_t*>(&plan.params);
          binding.bytes.assign(bytes, bytes + sizeof(TreeAttnParams));
          binding.writable = false;
          binding.name = "params";
          break;
        }
        case BufferRole::Query: binding = tensor_binding(in.query, b); break;
        case BufferRole::Key: binding = tensor_binding(in.key, b); break;
        case BufferRole::Value: binding = tensor_binding(in.value, b); break;
        case BufferRole::Mask: binding = tensor_binding(in.mask, b); break;
        case BufferRole::Offsets: binding = tensor_binding(in.offsets, b); break;
        case BufferRole::PartialO:
        case BufferRole::PartialM:
        case BufferRole::PartialL: binding = tensor_binding(scratch, b); break;
        case BufferRole::Output: binding = tensor_binding(out, b); break;
        case BufferRole::Lse: binding = tensor_binding(lse, b); break;
      }
      desc.buffers[int(b.index)] = std::move(binding);
    }

    LaunchRecord record;
    record.kernel = launch.kernel;
    record.counted = sim::launch(desc);
    if (i == 0) {
      record.modelled_read = modelled_main_reads(plan, call.vis, skipped).total();
      record.modelled_written = modelled_main_writes(plan);
    } else {
      record.modelled_read = modelled_reduce_reads(plan).total();
      record.modelled_written = modelled_reduce_writes(plan);
    }
    TORCH_CHECK(record.counted.device_bytes_read == record.modelled_read &&
                    record.counted.device_bytes_written == record.modelled_written,
                "Metal simulator: ", launch.kernel, " read ", record.counted.device_bytes_read, " and wrote ",
                record.counted.device_bytes_written, " device bytes; the launch plan models ",
                record.modelled_read, " and ", record.modelled_written);
    records.push_back(std::move(record));
  }
  return records;
}

std::tuple<at::Tensor, at::Tensor> sim_forward_with_lse(TREE_ATTN_ARGS_DECL) {
  const SimCall call = prepare_sim_call(query, key, value, mask, mask_offset, scale, softcap);
  at::Tensor out = empty_output(call.in), lse = empty_lse(call.in);
  if (!call.in.p.empty()) run_plan(call, out, lse);
  return {out, lse};
}

at::Tensor sim_forward(TREE_ATTN_ARGS_DECL) {
  return std::get<0>(sim_forward_with_lse(query, key, value, mask, mask_offset, scale, softcap));
}

std::string launch_plan_json(TREE_ATTN_ARGS_DECL) {
  const SimCall call = prepare_sim_call(query, key, value, mask, mask_offset, scale, softcap);
  return plan_to_json(call.in, call.plan, call.vis);
}

std::string sim_traffic_json(TREE_ATTN_ARGS_DECL) {
  const SimCall call = prepare_sim_call(query, key, value, mask, mask_offset, scale, softcap);
  at::Tensor out = empty_output(call.in), lse = empty_lse(call.in);
  std::vector<LaunchRecord> records;
  if (!call.in.p.empty()) records = run_plan(call, out, lse);
  std::ostringstream s;
  s << "{\"launches\": [";
  for (size_t i = 0; i < records.size(); ++i) {
    const LaunchRecord& r = records[i];
    s << (i ? ", " : "") << "{\"kernel\": \"" << r.kernel << "\", \"counted_read\": " << r.counted.device_bytes_read
      << ", \"counted_written\": " << r.counted.device_bytes_written << ", \"modelled_read\": " << r.modelled_read
      << ", \"modelled_written\": " << r.modelled_written << "}";
  }
  s << "], \"plan\": " << plan_to_json(call.in, call.plan, call.vis) << "}";
  return s.str();
}

#undef TREE_ATTN_ARGS_DECL

}  // namespace
}  // namespace tree_attn

#define TREE_ATTN_DEBUG_ARGS                                                           \
  "(Tensor query, Tensor key, Tensor value, Tensor mask, Tensor? mask_offset=None, " \
  "float? scale=None, float? softcap=None)"

TORCH_LIBRARY_FRAGMENT(tree_attn, m) {
  m.def("_launch_plan" TREE_ATTN_DEBUG_ARGS " -> str", &tree_attn::launch_plan_json);
  m.def("_metal_sim_traffic" TREE_ATTN_DEBUG_ARGS " -> str", &tree_attn::sim_traffic_json);
}

TORCH_LIBRARY_IMPL(tree_attn, CPU, m) {
  m.impl("_metal_sim_forward", &tree_attn::sim_forward);
  m.impl("_metal_sim_forward_with_lse", &tree_attn::sim_forward_with_lse);
}
