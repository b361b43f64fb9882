// The areas of the nanobind module jaxring._jaxring (module.cc), each bound
// by a function of its own file.
#pragma once

#include <nanobind/nanobind.h>

namespace jaxring::bindings {

void plans(nanobind::module_& m);         // plans.cc
void runtime(nanobind::module_& m);       // runtime.cc
void tcp(nanobind::module_& m);           // tcp.cc
void host_segment(nanobind::module_& m);  // host_segment.cc

}  // namespace jaxring::bindings
