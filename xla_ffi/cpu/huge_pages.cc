#include "cpu/huge_pages.h"

#include <sys/mman.h>

#include <cstdlib>
#include <cstring>

namespace jaxring {

bool huge_pages_advised() {
  static const bool advised = [] {
    const char* setting = std::getenv("JAXRING_HUGE_PAGES");
    if (setting != nullptr && *setting != '\0')
      return std::strcmp(setting, "0") != 0;
    return std::getenv("MALLOC_MMAP_THRESHOLD_") == nullptr;
  }();
  return advised;
}

void advise_huge_pages(void* p, int64_t bytes) {
  constexpr uintptr_t kHuge = uintptr_t{2} << 20;
  if (bytes < static_cast<int64_t>(2 * kHuge) || !huge_pages_advised()) return;
  const uintptr_t begin =
      (reinterpret_cast<uintptr_t>(p) + kHuge - 1) & ~(kHuge - 1);
  const uintptr_t end = (reinterpret_cast<uintptr_t>(p) + bytes) & ~(kHuge - 1);
  if (end > begin) {
    ::madvise(reinterpret_cast<void*>(begin), end - begin, MADV_HUGEPAGE);
  }
}

}  // namespace jaxring
