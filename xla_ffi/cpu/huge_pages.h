// Transparent huge pages for result buffers.
#pragma once

#include <cstdint>

namespace jaxring {

// A result buffer that XLA just allocated is usually fresh memory from the
// kernel, and faulting it in 4 KiB at a time while data arrives costs about
// as much as moving the data. Asking for transparent huge pages (where the
// system allows them only on request) cuts the faults 512-fold. Advice only:
// the memory's contents and ownership are unchanged; buffers under 4 MiB are
// left alone.
void advise_huge_pages(void* p, int64_t bytes);

}  // namespace jaxring
