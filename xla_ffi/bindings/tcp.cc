// Bindings: the TCP transport between processes (set up by
// jaxring._src.distributed).
#include <nanobind/nanobind.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include "cpu/net/shm_link.h"
#include "cpu/net/socket_io.h"
#include "cpu/net/tcp_transport.h"
#include "bindings/bindings.h"

namespace nb = nanobind;

void jaxring::bindings::tcp(nb::module_& m) {
  // The TCP transport between processes (set up by jaxring._src.distributed).
  m.def(
      "tcp_listen",
      [](const std::string& bind_host, int process, int processes,
         nb::bytes secret, nb::bytes job_id, bool use_shm) {
        jaxring::JobIdentity id;
        id.process = process;
        id.processes = processes;
        id.secret.assign(secret.c_str(), secret.size());
        id.job_id.assign(job_id.c_str(), job_id.size());
        std::string error;
        const int port = jaxring::tcp_listen(bind_host, id, use_shm, &error);
        if (port < 0)
          throw std::runtime_error("jaxring TCP transport: " + error);
        return port;
      },
      nb::arg("bind_host"), nb::arg("process"), nb::arg("processes"),
      nb::arg("secret"), nb::arg("job_id"), nb::arg("use_shm"),
      "Opens this process's listening socket for one job (its peers must "
      "prove the same secret and job id); returns its port. use_shm: "
      "whether shared-memory links with processes on this host are "
      "offered and taken.");
  m.def(
      "tcp_set_socket_buffer",
      [](int bytes) {
        if (bytes < 0)
          throw std::invalid_argument("a socket buffer of 0 or more bytes");
        jaxring::set_socket_buffer_bytes(bytes);
      },
      nb::arg("bytes"),
      "SO_SNDBUF and SO_RCVBUF of every TCP transport socket opened from now "
      "on, in bytes; 0: the kernel's autotuning.");
  m.def(
      "tcp_set_peers",
      [](const std::vector<std::string>& addresses,
         const std::vector<int>& same_host) {
        std::string error;
        if (!jaxring::tcp_set_peers(addresses, same_host, &error)) {
          throw std::runtime_error("jaxring TCP transport: " + error);
        }
      },
      nb::arg("addresses"), nb::arg("same_host"),
      "Sets every process's host:port, and the processes on this host.");
  m.def(
      "tcp_transport_info",
      [] {
        const jaxring::TcpTransportInfo i = jaxring::tcp_transport_info();
        nb::dict d;
        d["listening"] = i.listening;
        d["host"] = i.host;
        d["port"] = i.port;
        d["process"] = i.process;
        d["processes"] = i.processes;
        d["job_id"] = nb::bytes(i.job_id.data(), i.job_id.size());
        d["protocol_version"] = i.protocol_version;
        d["auth_library"] = i.auth_library;
        d["inbound"] = i.inbound;
        d["outbound"] = i.outbound;
        d["shm_inbound"] = i.shm_inbound;
        d["shm_outbound"] = i.shm_outbound;
        d["same_host"] = i.same_host;
        d["use_shm"] = i.use_shm;
        d["shm_unavailable"] = i.shm_unavailable;
        d["data_frames_by_device_thread"] = i.data_frames_by_device_thread;
        d["data_frames_by_sender_thread"] = i.data_frames_by_sender_thread;
        d["data_frames_finished_by_sender_thread"] =
            i.data_frames_finished_by_sender_thread;
        d["socket_buffer"] = jaxring::socket_buffer_bytes();
        d["lost_processes"] = i.lost_processes;
        d["refused_connections"] = i.refused_connections;
        d["last_refusal"] = i.last_refusal;
        d["pending_ops"] = i.pending_ops;
        return d;
      },
      "The TCP transport's state, for jaxring.transport_info().");
  m.def(
      "tcp_auth_library", &jaxring::tcp_auth_library,
      "The library that authenticates TCP peers, or '' if none was built in.");
}
