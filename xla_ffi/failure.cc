#include "failure.h"

#include <cstdlib>
#include <cstring>

namespace jaxring {

namespace {
constexpr const char* kNames[kNumFailureKinds] = {
    "internal", "peer_lost", "timeout", "mismatch", "invalid", "resource"};
constexpr const char kOpen[] = "[jaxring kind=";
}  // namespace

const char* failure_kind_name(FailureKind kind) {
  const int k = static_cast<int>(kind);
  return k >= 0 && k < kNumFailureKinds ? kNames[k] : kNames[0];
}

std::string tagged(FailureKind kind, int peer, const std::string& message) {
  return std::string(kOpen) + failure_kind_name(kind) +
         " peer=" + std::to_string(peer < 0 ? -1 : peer) + "] " + message;
}

bool parse_tag(const std::string& message, FailureKind* kind, int* peer,
               std::string* rest) {
  *rest = message;
  if (message.compare(0, sizeof(kOpen) - 1, kOpen) != 0) return false;
  const size_t name_at = sizeof(kOpen) - 1;
  const size_t space = message.find(" peer=", name_at);
  const size_t close = message.find("] ", name_at);
  if (space == std::string::npos || close == std::string::npos ||
      space > close) {
    return false;
  }
  const std::string name = message.substr(name_at, space - name_at);
  int k = 0;
  while (k < kNumFailureKinds && name != kNames[k]) ++k;
  if (k == kNumFailureKinds) return false;
  const std::string digits = message.substr(space + 6, close - space - 6);
  char* end = nullptr;
  const long p = std::strtol(digits.c_str(), &end, 10);
  if (digits.empty() || *end != '\0' || p < -1 || p > (1 << 30)) return false;
  *kind = static_cast<FailureKind>(k);
  *peer = static_cast<int>(p);
  *rest = message.substr(close + 2);
  return true;
}

}  // namespace jaxring
