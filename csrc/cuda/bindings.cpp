// Python bindings of the CUDA backend's host side (torch_tree_attn._C): the plan, the
// kernel registry (prebuilt cubins registered at import, the compile-once hook), and the
// pure-host launch planning the CPU tests check. Built on every platform: none of it
// touches a GPU until a kernel is launched.
#include "cuda/bindings.h"

#include <pybind11/functional.h>
#include <pybind11/stl.h>
#include <torch/csrc/utils/pybind.h>

#include "cuda/kernel_registry.h"
#include "cuda/launch.h"
#include "cuda/triton_plan.h"
#include "tree_attn.h"

namespace tree_attn::cuda {
namespace py = pybind11;
namespace {

py::dict spec_dict(const KernelSpec& s) {
  py::dict d;
  for (const auto& [name, member] : kSpecFields) d[name] = s.*member;
  return d;
}

KernelSpec spec_of(const py::dict& d) {
  KernelSpec s;
  for (const auto& [name, member] : kSpecFields) {
    TORCH_CHECK_VALUE(d.contains(name), "kernel spec lacks field '", name, "'");
    s.*member = d[name].cast<int32_t>();
  }
  TORCH_CHECK_VALUE(py::len(d) == kNumSpecFields, "kernel spec has ", py::len(d), " fields, expected ",
                    kNumSpecFields);
  return s;
}

std::optional<triton::TileConfig> config_of(const std::optional<std::vector<int>>& c) {
  if (!c) return std::nullopt;
  TORCH_CHECK_VALUE(c->size() == 4 || c->size() == 5,
                    "config must be (BLOCK_M, BLOCK_N, num_warps, num_stages[, WINDOW_N]), got ", c->size(),
                    " values");
  triton::TileConfig t{(*c)[0], (*c)[1], (*c)[2], (*c)[3], c->size() == 5 ? (*c)[4] : 0};
  return t;
}

std::optional<KernelChoice> choice_of(const std::optional<std::string>& name) {
  if (!name) return std::nullopt;
  if (*name == "auto") return KernelChoice::Auto;
  if (*name == "triton") return KernelChoice::Triton;
  if (*name == "hopper") return KernelChoice::Hopper;
  TORCH_CHECK_VALUE(false, "kernel must be 'auto', 'triton' or 'hopper', got '", *name, "'");
}

const char* choice_name(KernelChoice c) {
  switch (c) {
    case KernelChoice::Triton: return "triton";
    case KernelChoice::Hopper: return "hopper";
    default: return "auto";
  }
}

// Tensor-map descriptions from Python: [{"data_type", "elem_size", "swizzle", "block"}].
std::vector<TmaMeta> tma_of(const py::list& metas) {
  std::vector<TmaMeta> out;
  for (const auto& item : metas) {
    const py::dict d = item.cast<py::dict>();
    TmaMeta t;
    t.data_type = d["data_type"].cast<int>();
    t.elem_size = d["elem_size"].cast<int>();
    t.swizzle = d["swizzle"].cast<int>();
    t.block = d["block"].cast<std::vector<uint32_t>>();
    TORCH_CHECK_VALUE(t.block.size() == 4, "a tensor map's block must have 4 dims, got ", t.block.size());
    out.push_back(std::move(t));
  }
  return out;
}

// C++ exceptions of the contract as Python's ValueError / TypeError.
template <class F>
auto translating(F&& f) -> decltype(f()) {
  try {
    return f();
  } catch (const c10::ValueError& e) {
    throw py::value_error(e.what_without_backtrace());
  } catch (const c10::TypeError& e) {
    throw py::type_error(e.what_without_backtrace());
  }
}

}  // namespace

void bind(py::module_& m) {
  py::class_<triton::Plan>(m, "TritonPlan", "The CUDA kernels' launch plan (csrc/cuda/triton_plan.h).")
      .def_property_readonly("kernel",
                             [](const triton::Plan& p) {
                               return p.kernel == triton::MainKernel::Hopper ? "hopper" : "triton";
                             })
      .def_readonly("block_m", &triton::Plan::block_m)
      .def_readonly("block_n", &triton::Plan::block_n)
      .def_readonly("block_d", &triton::Plan::block_d)
      .def_readonly("window_n", &triton::Plan::window_n)
      .def_readonly("num_warps", &triton::Plan::num_warps)
      .def_readonly("num_stages", &triton::Plan::num_stages)
      .def_readonly("row_blocks", &triton::Plan::row_blocks)
      .def_readonly("num_splits", &triton::Plan::num_splits)
      .def_readonly("window_units", &triton::Plan::window_units)
      .def_readonly("skip_unseen", &triton::Plan::skip_unseen)
      .def_readonly("reduce_block_r", &triton::Plan::reduce_block_r)
      .def_property_readonly("kv_reads", &triton::Plan::kv_reads)
      .def("__repr__", [](const triton::Plan& p) {
        return std::string("TritonPlan(kernel=") + (p.kernel == triton::MainKernel::Hopper ? "hopper" : "triton") +
               ", block_m=" + std::to_string(p.block_m) + ", block_n=" + std::to_string(p.block_n) +
               ", window_n=" + std::to_string(p.window_n) + ", num_warps=" + std::to_string(p.num_warps) +
               ", num_stages=" + std::to_string(p.num_stages) + ", row_blocks=" + std::to_string(p.row_blocks) +
               ", num_splits=" + std::to_string(p.num_splits) + ", skip_unseen=" + std::to_string(p.skip_unseen) +
               ")";
      });

  m.def("triton_plan",
        [](int64_t D, bool half_dot, int64_t T, int64_t rows_per_head, int64_t batch_heads, int64_t S, int64_t M,
           int num_sms, std::optional<int> num_splits, std::optional<std::vector<int>> config) {
          return translating([&] {
            return triton::choose(D, half_dot, T, rows_per_head, batch_heads, S, M, num_sms, num_splits,
                                  config_of(config));
          });
        },
        py::arg("D"), py::arg("half_dot"), py::arg("T"), py::arg("rows_per_head"), py::arg("batch_heads"),
        py::arg("S"), py::arg("M"), py::arg("num_sms"), py::arg("num_splits") = py::none(),
        py::arg("config") = py::none());
  m.def("triton_table", [] {
    py::dict table;
    for (int64_t D : {64, 96, 128, 256, 512})
      for (bool half : {true, false}) {
        const auto c = triton::table_config(D, half);
        table[py::make_tuple(D, half ? "half" : "f32")] =
            py::make_tuple(c.block_m, c.block_n, c.num_warps, c.num_stages, c.window_n);
      }
    return table;
  });
  m.def("hopper_table", [] {
    py::dict table;
    for (int64_t D : {64, 96, 128, 256, 512})
      if (const auto c = triton::hopper_config(D)) table[py::int_(D)] = py::make_tuple(c->consumer_warps, c->block_n, c->stages);
    return table;
  });
  m.def("hopper_programs_per_sm", [](int64_t D, int consumer_warps, int block_n, int stages) {
    return triton::hopper_programs_per_sm(D, triton::HopperConfig{consumer_warps, block_n, stages});
  });
  m.def("hopper_plan",
        [](int64_t D, int64_t rows_per_head, int64_t batch_heads, int64_t S, int64_t M, int num_sms,
           std::optional<int> num_splits) {
          return translating([&] { return triton::choose_hopper(D, rows_per_head, batch_heads, S, M, num_sms, num_splits); });
        },
        py::arg("D"), py::arg("rows_per_head"), py::arg("batch_heads"), py::arg("S"), py::arg("M"), py::arg("num_sms"),
        py::arg("num_splits") = py::none());
  m.attr("HOPPER_WINDOW_COST") = triton::kHopperWindowCost;
  m.def("triton_makespan", &triton::makespan, py::arg("tiles"), py::arg("window"), py::arg("programs"),
        py::arg("num_sms"), py::arg("splits"), py::arg("per_sm") = 1);
  m.def("triton_choose_splits", &triton::choose_splits, py::arg("tiles"), py::arg("window"), py::arg("programs"),
        py::arg("num_sms"), py::arg("per_sm") = 1);
  m.def("triton_window_tiles", &triton::window_tiles);
  m.def("triton_programs_per_sm", &triton::programs_per_sm);
  m.def("triton_reduce_block", &triton::reduce_block);
  m.def("triton_constants", [] {
    py::dict c;
    c["REGISTERS_PER_SM"] = triton::kRegistersPerSm;
    c["REGISTERS_PER_THREAD"] = triton::kRegistersPerThread;
    c["WINDOW_N"] = triton::kWindowN;
    c["PROGRAM_OVERHEAD_TILES"] = triton::kProgramOverheadTiles;
    c["REDUCE_COST_TILES"] = triton::kReduceCostTiles;
    c["REDUCE_COST_PER_SPLIT"] = triton::kReduceCostPerSplit;
    c["WINDOW_COST_FACTOR"] = triton::kWindowCostFactor;
    c["MAX_SPLITS"] = triton::kMaxSplits;
    c["REDUCE_ELEMS"] = triton::kReduceElems;
    c["REDUCE_CHUNK"] = triton::kReduceChunk;
    c["REDUCE_WARPS"] = triton::kReduceWarps;
    return c;
  });

  m.def("cuda_spec_fields", [] {
    std::vector<std::string> names;
    for (const auto& f : kSpecFields) names.emplace_back(f.first);
    return names;
  });
  m.def("cuda_register_kernel",
        [](const py::dict& spec, py::bytes cubin, const std::string& path, const std::string& function, int shared,
           int num_warps, int scratch_args, bool prebuilt, const py::list& tma) {
          KernelBinary b;
          b.tma = translating([&] { return tma_of(tma); });
          b.cubin = std::string(cubin);
          b.path = path;
          b.function = function;
          b.shared = shared;
          b.num_warps = num_warps;
          b.scratch_args = scratch_args;
          b.prebuilt = prebuilt;
          TORCH_CHECK_VALUE(!b.cubin.empty() || !b.path.empty(), "a kernel needs its cubin or a path to it");
          KernelRegistry::instance().add(translating([&] { return spec_of(spec); }), std::move(b));
        },
        py::arg("spec"), py::arg("cubin"), py::arg("path"), py::arg("function"), py::arg("shared"),
        py::arg("num_warps"), py::arg("scratch_args"), py::arg("prebuilt"), py::arg("tma") = py::list(),
        "Registers a compiled kernel (prebuilt: its cubin is read from `path` at first use; tma: its "
        "tensor-descriptor parameters' encodings).");
  m.def("cuda_set_compiler",
        [](py::function compile) {
          // The hook returns (cubin bytes, function name, shared bytes, num_warps, scratch args,
          // tensor-map descriptions).
          KernelRegistry::instance().set_compiler([compile](const KernelSpec& spec) {
            py::gil_scoped_acquire gil;
            py::tuple r = compile(spec_dict(spec));
            KernelBinary b;
            b.cubin = r[0].cast<std::string>();
            b.function = r[1].cast<std::string>();
            b.shared = r[2].cast<int>();
            b.num_warps = r[3].cast<int>();
            b.scratch_args = r[4].cast<int>();
            if (py::len(r) > 5) b.tma = tma_of(r[5].cast<py::list>());
            return b;
          });
        },
        "Installs the run-time compiler for kernel specs no prebuilt kernel covers.");
  m.def("cuda_kernel_origin",
        [](const py::dict& spec) { return KernelRegistry::instance().origin(translating([&] { return spec_of(spec); })); },
        "'prebuilt', 'compiled' or 'missing' for a kernel spec (no loading, no compiling).");
  m.def("cuda_registry_stats", [] {
    const auto s = KernelRegistry::instance().stats();
    py::dict d;
    d["prebuilt"] = s.prebuilt;
    d["compiled"] = s.compiled;
    d["loaded"] = s.loaded;
    return d;
  });
  m.def("cuda_plan_launch",
        [](const at::Tensor& query, const at::Tensor& key, const at::Tensor& value, const at::Tensor& mask,
           const std::optional<at::Tensor>& mask_offset, std::optional<double> scale, std::optional<double> softcap,
           const std::optional<at::Tensor>& sinks, int arch, int num_sms, std::optional<int> num_splits,
           std::optional<std::vector<int>> config, std::optional<std::string> kernel) {
          return translating([&] {
            const Prepared in = prepare(query, key, value, mask, mask_offset, scale, softcap, sinks,
                                        OffsetCheck::ClampInKernelAnyInt);
            const Launch L = plan_launch(in, arch, num_sms, num_splits, config_of(config), choice_of(kernel));
            py::object reduce = L.split() ? py::object(spec_dict(L.reduce)) : py::object(py::none());
            return py::make_tuple(L.plan, spec_dict(L.main), reduce);
          });
        },
        py::arg("query"), py::arg("key"), py::arg("value"), py::arg("mask"), py::arg("mask_offset") = py::none(),
        py::arg("scale") = py::none(), py::arg("softcap") = py::none(), py::arg("sinks") = py::none(),
        py::kw_only(), py::arg("arch"), py::arg("num_sms"), py::arg("num_splits") = py::none(),
        py::arg("config") = py::none(), py::arg("kernel") = py::none(),
        "(plan, main spec, reduce spec or None) of a call on a GPU of compute capability `arch`: host only. "
        "kernel: 'auto', 'triton', 'hopper' or None (the process default).");
  m.def("cuda_hopper_why_not",
        [](const at::Tensor& query, const at::Tensor& key, const at::Tensor& value, const at::Tensor& mask,
           const std::optional<at::Tensor>& mask_offset, std::optional<double> scale, std::optional<double> softcap,
           const std::optional<at::Tensor>& sinks, int arch) {
          return translating([&] {
            const Prepared in = prepare(query, key, value, mask, mask_offset, scale, softcap, sinks,
                                        OffsetCheck::ClampInKernelAnyInt);
            return hopper_why_not(in, arch);
          });
        },
        py::arg("query"), py::arg("key"), py::arg("value"), py::arg("mask"), py::arg("mask_offset") = py::none(),
        py::arg("scale") = py::none(), py::arg("softcap") = py::none(), py::arg("sinks") = py::none(),
        py::kw_only(), py::arg("arch") = 90,
        "Why the Hopper kernel would not run this call on compute capability `arch` ('' when it would).");
  m.def("cuda_set_kernel_choice",
        [](const std::string& name) { set_default_choice(*translating([&] { return choice_of(name); })); },
        "The process default main kernel: 'auto' (Hopper on sm_90 where it covers the call), 'triton', 'hopper'.");
  m.def("cuda_kernel_choice", [] { return std::string(choice_name(default_choice())); });
  m.def("cuda_forward_with_lse",
        [](const at::Tensor& query, const at::Tensor& key, const at::Tensor& value, const at::Tensor& mask,
           const std::optional<at::Tensor>& mask_offset, std::optional<double> scale, std::optional<double> softcap,
           const std::optional<at::Tensor>& sinks, std::optional<int> num_splits,
           std::optional<std::vector<int>> config, std::optional<std::string> kernel) {
          return translating([&] {
            const Prepared in = prepare(query, key, value, mask, mask_offset, scale, softcap, sinks,
                                        OffsetCheck::ClampInKernelAnyInt);
            TORCH_CHECK_VALUE(in.query.is_cuda(), "cuda_forward_with_lse: query must be a CUDA tensor, got ",
                              in.query.device());
            at::Tensor out = empty_output(in), lse = empty_lse(in);
            if (!in.p.empty()) {
              const auto choice = choice_of(kernel);
              py::gil_scoped_release no_gil;
              run(in, out, lse, num_splits, config_of(config), choice);
            }
            return py::make_tuple(out, lse);
          });
        },
        py::arg("query"), py::arg("key"), py::arg("value"), py::arg("mask"), py::arg("mask_offset") = py::none(),
        py::arg("scale") = py::none(), py::arg("softcap") = py::none(), py::arg("sinks") = py::none(),
        py::kw_only(), py::arg("num_splits") = py::none(), py::arg("config") = py::none(),
        py::arg("kernel") = py::none(),
        "The CUDA op with the plan's splits / tiles / main kernel overridden (tests, tuning).");
}

}  // namespace tree_attn::cuda
