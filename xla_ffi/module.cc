// The nanobind module jaxring._jaxring: FFI handler capsules for the CPU
// backend, the attributes' values, and each area's bindings (bindings/).
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>

#include <stdexcept>
#include <string>

#include "algorithm.h"
#include "bindings/bindings.h"
#include "cpu/allreduce_handler.h"
#include "reduce.h"

namespace nb = nanobind;

namespace {

template <typename T>
nb::capsule encapsulate_ffi(T* fn) {
  static_assert(std::is_invocable_r_v<XLA_FFI_Error*, T, XLA_FFI_CallFrame*>,
                "an XLA FFI handler");
  return nb::capsule(reinterpret_cast<void*>(fn));
}

}  // namespace

NB_MODULE(_jaxring, m) {
  m.doc() = "jaxring C++ core: XLA FFI handlers and the ring plans.";

  m.def("registrations", []() {
    nb::dict d;
    d["jaxring_allreduce_cpu"] = encapsulate_ffi(jaxring::AllreduceCpu);
    d["jaxring_allreduce_start_cpu"] =
        encapsulate_ffi(jaxring::AllreduceStartCpu);
    d["jaxring_allreduce_done_cpu"] =
        encapsulate_ffi(jaxring::AllreduceDoneCpu);
    return d;
  });

  jaxring::bindings::plans(m);
  jaxring::bindings::runtime(m);
  jaxring::bindings::tcp(m);
  jaxring::bindings::host_segment(m);

  // Reduction kernels on raw bytes, for tests of rounding and wrapping.
  m.def("reduce_bytes", [](int elem_type, int op, nb::bytes a, nb::bytes b) {
    if (a.size() != b.size()) throw std::invalid_argument("size mismatch");
    const auto t = static_cast<jaxring::ElemType>(elem_type);
    const int64_t esize = jaxring::elem_bytes(t);
    if (esize == 0 || a.size() % esize) throw std::invalid_argument("bad type");
    jaxring::ReduceOp rop;
    if (!jaxring::reduce_op_from_int(op, &rop))
      throw std::invalid_argument("bad op");
    std::string out(a.size(), '\0');
    jaxring::reduce(t, rop, out.data(), a.c_str(), b.c_str(),
                    static_cast<int64_t>(a.size()) / esize);
    return nb::bytes(out.data(), out.size());
  });

  // The values of the custom calls' attributes, named once here for Python.
  m.attr("REDUCE_OPS") = [] {
    nb::dict d;
    d["sum"] = static_cast<int>(jaxring::ReduceOp::kSum);
    d["prod"] = static_cast<int>(jaxring::ReduceOp::kProd);
    d["min"] = static_cast<int>(jaxring::ReduceOp::kMin);
    d["max"] = static_cast<int>(jaxring::ReduceOp::kMax);
    return d;
  }();
  m.attr("ALGORITHMS") = [] {
    nb::dict d;
    d["ring"] = static_cast<int>(jaxring::Algorithm::kRing);
    d["direct"] = static_cast<int>(jaxring::Algorithm::kDirect);
    d["nccl"] = static_cast<int>(jaxring::Algorithm::kNccl);
    d["exchange"] = static_cast<int>(jaxring::Algorithm::kExchange);
    return d;
  }();
  m.attr("ELEM_TYPES") = [] {
    nb::dict d;
    for (int i = 0; i <= static_cast<int>(jaxring::ElemType::kU64); ++i) {
      d[jaxring::elem_type_name(static_cast<jaxring::ElemType>(i))] = i;
    }
    return d;
  }();
#ifdef JAXRING_VERSION
  m.attr("__version__") = JAXRING_VERSION;
#endif
  m.attr("built_with_jaxlib") = JAXRING_BUILT_WITH_JAXLIB;
}
