// The nanobind module jaxring._jaxring_cuda: the CUDA backend's FFI handler
// capsule, NCCL unique ids and communicators, and device-side checks of the
// reduce kernels for the GPU tests and benchmarks.
#include <cuda_runtime.h>
#include <nanobind/nanobind.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>

#include <cstdlib>
#include <stdexcept>
#include <string>

#include "../reduce.h"
#include "allreduce_cuda.h"
#include "ring_ops.h"
#include "split_phase_cuda.h"
#include "checks.h"
#include "communicators.h"
#include "reduce_kernels.h"
#include "watchdog.h"

namespace nb = nanobind;

namespace {

void raise_if(const jaxring::cuda::Status& s) {
  if (s) throw std::runtime_error(*s);
}

// Device memory freed on scope exit (the test helpers below only).
struct DeviceBuffer {
  void* ptr = nullptr;
  explicit DeviceBuffer(size_t n) {
    if (cudaMalloc(&ptr, n) != cudaSuccess) {
      throw std::runtime_error("jaxring CUDA backend: cudaMalloc failed");
    }
  }
  ~DeviceBuffer() { cudaFree(ptr); }
};

jaxring::cuda::Status reduce_on_device(int elem_type, int op,
                                       const std::string& a,
                                       const std::string& b, std::string* out) {
  const auto t = static_cast<jaxring::ElemType>(elem_type);
  const int64_t esize = jaxring::elem_bytes(t);
  jaxring::ReduceOp rop;
  if (esize == 0 || a.size() != b.size() || a.size() % esize ||
      !jaxring::reduce_op_from_int(op, &rop)) {
    return "reduce_on_device: bad type, op or sizes";
  }
  out->assign(a.size(), '\0');
  if (a.empty()) return std::nullopt;
  DeviceBuffer da(a.size()), db(b.size());
  JAXRING_CUDA_CHECK(
      cudaMemcpy(da.ptr, a.data(), a.size(), cudaMemcpyHostToDevice));
  JAXRING_CUDA_CHECK(
      cudaMemcpy(db.ptr, b.data(), b.size(), cudaMemcpyHostToDevice));
  JAXRING_CUDA_CHECK(jaxring::cuda::launch_reduce(
      t, rop, da.ptr, db.ptr, static_cast<int64_t>(a.size()) / esize, nullptr));
  JAXRING_CUDA_CHECK(
      cudaMemcpy(out->data(), da.ptr, a.size(), cudaMemcpyDeviceToHost));
  return std::nullopt;
}

// Seconds per call of the reduce kernel and of a device-to-device copy of
// the same size, each the mean of `iters` after a warm-up, timed with
// events on one stream.
jaxring::cuda::Status time_reduce_and_copy(int elem_type, int64_t nbytes,
                                           int iters,
                                           std::pair<double, double>* out) {
  const auto t = static_cast<jaxring::ElemType>(elem_type);
  const int64_t esize = jaxring::elem_bytes(t);
  if (esize == 0 || nbytes <= 0 || nbytes % esize || iters < 1) {
    return "time_reduce_and_copy: bad type, size or iterations";
  }
  DeviceBuffer dst(nbytes), src(nbytes);
  JAXRING_CUDA_CHECK(cudaMemset(dst.ptr, 0, nbytes));
  JAXRING_CUDA_CHECK(cudaMemset(src.ptr, 0, nbytes));
  cudaEvent_t e0, e1;
  JAXRING_CUDA_CHECK(cudaEventCreate(&e0));
  JAXRING_CUDA_CHECK(cudaEventCreate(&e1));
  float ms_reduce = 0, ms_copy = 0;
  for (int pass = 0; pass < 2; ++pass) {  // pass 0 warms up
    JAXRING_CUDA_CHECK(cudaEventRecord(e0, nullptr));
    for (int i = 0; i < iters; ++i) {
      JAXRING_CUDA_CHECK(
          jaxring::cuda::launch_reduce(t, jaxring::ReduceOp::kSum, dst.ptr,
                                       src.ptr, nbytes / esize, nullptr));
    }
    JAXRING_CUDA_CHECK(cudaEventRecord(e1, nullptr));
    JAXRING_CUDA_CHECK(cudaEventSynchronize(e1));
    JAXRING_CUDA_CHECK(cudaEventElapsedTime(&ms_reduce, e0, e1));
    JAXRING_CUDA_CHECK(cudaEventRecord(e0, nullptr));
    for (int i = 0; i < iters; ++i) {
      JAXRING_CUDA_CHECK(cudaMemcpyAsync(dst.ptr, src.ptr, nbytes,
                                         cudaMemcpyDeviceToDevice, nullptr));
    }
    JAXRING_CUDA_CHECK(cudaEventRecord(e1, nullptr));
    JAXRING_CUDA_CHECK(cudaEventSynchronize(e1));
    JAXRING_CUDA_CHECK(cudaEventElapsedTime(&ms_copy, e0, e1));
  }
  cudaEventDestroy(e0);
  cudaEventDestroy(e1);
  *out = {ms_reduce / 1e3 / iters, ms_copy / 1e3 / iters};
  return std::nullopt;
}

}  // namespace

NB_MODULE(_jaxring_cuda, m) {
  m.doc() = "jaxring's CUDA backend: NCCL rings as XLA FFI custom calls";

  // A ring allreduce issues one communicator per ring on streams of its
  // own, side by side. Since NCCL 2.26 that is safe only with implicit
  // launch order (and the same host order on every rank, which ring_ops.cc
  // keeps). NCCL reads the variable once, at its first use in the process,
  // so it is set here, before any NCCL call; a user's own value stays.
  setenv("NCCL_LAUNCH_ORDER_IMPLICIT", "1", /*overwrite=*/0);

  m.def(
      "registrations",
      []() {
        nb::dict d;
        d["jaxring_allreduce_cuda"] =
            nb::capsule(reinterpret_cast<void*>(jaxring::cuda::AllreduceCuda));
        d["jaxring_allreduce_start_cuda"] = nb::capsule(
            reinterpret_cast<void*>(jaxring::cuda::AllreduceStartCuda));
        d["jaxring_allreduce_done_cuda"] = nb::capsule(
            reinterpret_cast<void*>(jaxring::cuda::AllreduceDoneCuda));
        return d;
      },
      "FFI handler capsules by target name, for platform CUDA.");

  m.def(
      "new_unique_id",
      []() {
        jaxring::cuda::UniqueIdBytes id;
        raise_if(jaxring::cuda::new_unique_id(&id));
        return nb::bytes(id.data(), id.size());
      },
      "A fresh NCCL unique id (128 bytes); needs no GPU.");
  m.attr("UNIQUE_ID_BYTES") = NCCL_UNIQUE_ID_BYTES;
  // The "algorithm" attribute's values are named once, by the core module
  // (_jaxring.ALGORITHMS); this backend runs "ring" and "nccl".

  m.def("set_process_index", &jaxring::cuda::set_process_index,
        nb::arg("index"),
        "This process's index, to find its devices in the rank tables.");
  m.def("destroy_communicators", &jaxring::cuda::destroy_communicators,
        "Finalizes and destroys every cached NCCL communicator.");
  m.def("communicator_count", &jaxring::cuda::communicator_count,
        "NCCL communicators in the cache.");
  m.def("split_phase_pending", &jaxring::cuda::split_phase_pending_cuda,
        "Split-phase starts whose done has not run yet.");
  m.def("watched_count", &jaxring::cuda::watched_count,
        "Ring operations the watchdog still follows (not finished yet).");

  m.def(
      "nccl_version",
      []() {
        int v = 0;
        if (ncclGetVersion(&v) != ncclSuccess) v = 0;
        return v;
      },
      "The linked NCCL's version code (e.g. 23206 for 2.32.6).");
  m.attr("NCCL_HEADER_VERSION") = NCCL_VERSION_CODE;
  m.def(
      "cuda_runtime_version",
      []() {
        int v = 0;
        if (cudaRuntimeGetVersion(&v) != cudaSuccess) v = 0;
        return v;
      },
      "The CUDA runtime's version (e.g. 13000).");
  m.def(
      "device_count",
      []() {
        int n = 0;
        // No driver or no device: zero, not an error (the import must work on
        // machines without a GPU).
        if (cudaGetDeviceCount(&n) != cudaSuccess) {
          cudaGetLastError();
          n = 0;
        }
        return n;
      },
      "CUDA devices visible to this process (0 without a driver).");

  m.def(
      "reduce_on_device",
      [](int elem_type, int op, nb::bytes a, nb::bytes b) {
        std::string out;
        raise_if(reduce_on_device(elem_type, op,
                                  std::string(a.c_str(), a.size()),
                                  std::string(b.c_str(), b.size()), &out));
        return nb::bytes(out.data(), out.size());
      },
      nb::arg("elem_type"), nb::arg("op"), nb::arg("a"), nb::arg("b"),
      "a (op) b computed by the CUDA reduce kernel on device 0 (tests).");
  m.def(
      "time_reduce_and_copy",
      [](int elem_type, int64_t nbytes, int iters) {
        std::pair<double, double> out;
        raise_if(time_reduce_and_copy(elem_type, nbytes, iters, &out));
        return out;
      },
      nb::arg("elem_type"), nb::arg("nbytes"), nb::arg("iters"),
      "(reduce seconds, device-to-device copy seconds) per call (benchmarks).");
}
