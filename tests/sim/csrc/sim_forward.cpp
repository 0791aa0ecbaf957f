// The Metal backend's launch plan, executed by the CPU simulator of the Metal shaders:
// test apparatus, never part of the product.
//
// `tree_attn_sim::forward(_with_lse)` have the product op's exact schema and run on CPU
// tensors exactly what the MPS backend encodes: the same plan (csrc/metal/plan.h), the
// same shader source, the same buffer byte offsets, with offsets clamped in the kernel
// rather than checked on the host. They are a backend of the one backend interface
// (csrc/backend.h), so validation and allocation are the product's own. Each launch's
// counted device bytes must equal the traffic model (traffic.h), or the call fails.
//
// Debug ops for tests and reports (CPU tensors, same arguments as forward):
//   launch_plan -> str  the plan and its traffic model as JSON
//   traffic -> str      counted vs modelled bytes of each launch, and all its counters
//                       (runtime.h counter_items), as JSON
//   plan_kernel_names -> str[]   every kernel name a plan can contain (from the table)
//   set_kernel_family(str)       "auto", "vector" or "matrix": the main kernel family every
//                                later plan of this process uses (the plan's internal
//                                override, for tests); returns the previous setting
// (`launch` and `kernels`, the raw simulator, are in sim_ops.cpp.)
#include <torch/library.h>

#include <atomic>
#include <limits>
#include <sstream>

#include "backend.h"
#include "metal/plan.h"
#include "runtime.h"
#include "schema.h"
#include "traffic.h"
#include "tree_attn.h"

namespace tree_attn {
namespace {

// The family override of set_kernel_family (tests set it around a call, one at a time).
std::atomic<KernelFamily> g_family{KernelFamily::Auto};

Plan sim_plan(const Prepared& in) { return make_plan(in, g_family.load()); }

std::string set_kernel_family(const std::string& name) {
  KernelFamily family;
  if (name == "auto") family = KernelFamily::Auto;
  else if (name == "vector") family = KernelFamily::Vector;
  else if (name == "matrix") family = KernelFamily::Matrix;
  else TORCH_CHECK_VALUE(false, "set_kernel_family: expected 'auto', 'vector' or 'matrix', got '", name, "'");
  return family_name(g_family.exchange(family));
}

std::vector<Visibility> visibility_of(const Prepared& in) {
  std::vector<int64_t> offsets;
  if (in.p.has_mask_offset) {
    const int32_t* raw = in.mask_offset.data_ptr<int32_t>();
    offsets.assign(raw, raw + in.p.B);
  }
  return visibility_from_offsets(in.p, offsets);
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
std::vector<LaunchRecord> run_plan(const Prepared& in, const Plan& plan, at::Tensor& out, at::Tensor& lse) {
  TORCH_CHECK_VALUE(in.query.device().is_cpu(), "the Metal simulator runs on CPU tensors, got query on ",
                    in.query.device());
  // Scratch, out and lse start as NaN: a kernel that reads a partial nobody wrote, or
  // leaves an output element unwritten, shows up in the result.
  const at::Tensor scratch = at::full({int64_t(plan.scratch_bytes / sizeof(float))},
                                      std::numeric_limits<float>::quiet_NaN(), in.query.options().dtype(at::kFloat));
  out.fill_(std::numeric_limits<double>::quiet_NaN());
  lse.fill_(std::numeric_limits<double>::quiet_NaN());
  const CallTensors tensors{in, scratch, out, lse};

  const std::vector<Visibility> vis = visibility_of(in);
  const uint64_t skipped = count_skipped_keys(in, plan, vis);
  std::vector<LaunchRecord> records;
  for (size_t i = 0; i < plan.launches.size(); ++i) {
    const Launch& launch = plan.launches[i];
    sim::LaunchDesc desc;
    desc.kernel = launch.kernel;
    desc.grid = launch.grid;
    desc.threads = launch.threads;
    if (launch.threadgroup_memory_bytes) desc.threadgroup_memory[0] = launch.threadgroup_memory_bytes;
    desc.constants = launch.constants;
    for (const BufferBinding& b : launch.buffers) {
      sim::Binding binding;
      if (b.role == BufferRole::Params) {
        const auto* bytes = reinterpret_cast<const uint8_t*>(&plan.params);
        binding.bytes.assign(bytes, bytes + sizeof(TreeAttnParams));
        binding.writable = false;
        binding.name = role_name(b.role);
      } else {
        binding = tensor_binding(tensors.tensor_for(b.role), b);
      }
      desc.buffers[int(b.index)] = std::move(binding);
    }

    LaunchRecord record;
    record.kernel = launch.kernel;
    record.counted = sim::launch(desc);
    if (i == 0) {
      record.modelled_read = modelled_main_reads(plan, vis, skipped).total();
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

// The simulator as a backend of the one backend interface: what the MPS backend would
// do, with the same offset handling (clamped in the kernel, not checked on the host).
struct SimBackend {
  static constexpr OffsetCheck kOffsetCheck = OffsetCheck::ClampInKernel;
  static void run(const Prepared& in, at::Tensor& out, at::Tensor& lse) { run_plan(in, sim_plan(in), out, lse); }
};

#define TREE_ATTN_ARGS_DECL                                                                           \
  const at::Tensor &query, const at::Tensor &key, const at::Tensor &value, const at::Tensor &mask, \
      const c10::optional<at::Tensor>&mask_offset, c10::optional<double> scale,                     \
      c10::optional<double> softcap, const c10::optional<at::Tensor>&sinks
#define TREE_ATTN_ARGS query, key, value, mask, mask_offset, scale, softcap, sinks

Prepared prepare_for_sim(TREE_ATTN_ARGS_DECL) {
  Prepared in = prepare(TREE_ATTN_ARGS, SimBackend::kOffsetCheck);
  TORCH_CHECK_VALUE(in.query.device().is_cpu(), "the Metal simulator runs on CPU tensors, got query on ",
                    in.query.device());
  return in;
}

std::string launch_plan_json(TREE_ATTN_ARGS_DECL) {
  const Prepared in = prepare_for_sim(TREE_ATTN_ARGS);
  return plan_to_json(in, sim_plan(in), visibility_of(in));
}

std::string traffic_json(TREE_ATTN_ARGS_DECL) {
  const Prepared in = prepare_for_sim(TREE_ATTN_ARGS);
  const Plan plan = sim_plan(in);
  at::Tensor out = empty_output(in), lse = empty_lse(in);
  std::vector<LaunchRecord> records;
  if (!in.p.empty()) records = run_plan(in, plan, out, lse);
  std::ostringstream s;
  s << "{\"launches\": [";
  for (size_t i = 0; i < records.size(); ++i) {
    const LaunchRecord& r = records[i];
    s << (i ? ", " : "") << "{\"kernel\": \"" << r.kernel << "\", \"counted_read\": " << r.counted.device_bytes_read
      << ", \"counted_written\": " << r.counted.device_bytes_written << ", \"modelled_read\": " << r.modelled_read
      << ", \"modelled_written\": " << r.modelled_written << ", \"counters\": {";
    bool first = true;
    for (const auto& [name, value] : sim::counter_items(r.counted)) {
      s << (first ? "" : ", ") << "\"" << name << "\": " << value;
      first = false;
    }
    s << "}}";
  }
  s << "], \"plan\": " << plan_to_json(in, plan, visibility_of(in)) << "}";
  return s.str();
}

#undef TREE_ATTN_ARGS
#undef TREE_ATTN_ARGS_DECL

}  // namespace
}  // namespace tree_attn

TORCH_LIBRARY(tree_attn_sim, m) {
  m.def("forward" TREE_ATTN_SCHEMA_ARGS " -> Tensor");
  m.def("forward_with_lse" TREE_ATTN_SCHEMA_ARGS " -> (Tensor, Tensor)");
  m.def("launch_plan" TREE_ATTN_SCHEMA_ARGS " -> str", &tree_attn::launch_plan_json);
  m.def("traffic" TREE_ATTN_SCHEMA_ARGS " -> str", &tree_attn::traffic_json);
  m.def("plan_kernel_names() -> str[]", [] { return tree_attn::plan_kernel_names(); });
  m.def("set_kernel_family(str family) -> str", &tree_attn::set_kernel_family);
}

TREE_ATTN_REGISTER_BACKEND(tree_attn_sim, CPU, tree_attn::SimBackend)
