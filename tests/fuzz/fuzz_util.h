// Helpers shared by the libFuzzer targets (docs/security.md, "Fuzzing").
//
// What a target accepts as a correct outcome: a result, or moe::Error (the engine's refusal,
// which names the input and the reason). Anything else escapes and libFuzzer reports it: a crash,
// a sanitizer report, another exception (std::bad_alloc, std::out_of_range...), a GLib critical
// (made fatal here: it means the engine called GLib with something invalid), an abort.
#pragma once

#include <glib.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <string_view>

#include "moe/error.h"

namespace moe_fuzz {

// Once per process: a GLib critical or warning (JSON-GLib, GLib and gdk-pixbuf report misuse that
// way and then carry on with a default value) aborts, so that libFuzzer records the input. (GLib's
// own fatal-log path raises SIGTRAP, which libFuzzer does not catch: no input would be saved.)
// `fatal`: the levels that abort; the others are dropped silently.
inline GLogLevelFlags fatal_glib_levels = static_cast<GLogLevelFlags>(G_LOG_LEVEL_CRITICAL | G_LOG_LEVEL_WARNING);

inline void glib_log_abort(const gchar* domain, GLogLevelFlags level, const gchar* message, gpointer) {
  if ((level & (fatal_glib_levels | G_LOG_LEVEL_ERROR)) == 0) return;
  std::fprintf(stderr, "%s-%s: %s\n", domain != nullptr ? domain : "(none)",
               (level & G_LOG_LEVEL_WARNING) != 0 ? "WARNING" : "CRITICAL", message);
  std::abort();
}

inline void init_glib(GLogLevelFlags fatal = static_cast<GLogLevelFlags>(G_LOG_LEVEL_CRITICAL | G_LOG_LEVEL_WARNING)) {
  fatal_glib_levels = fatal;
  g_log_set_default_handler(glib_log_abort, nullptr);
}

// An anonymous in-memory file (memfd) reachable by path (/proc/self/fd/N), for engine loaders that
// take a path. One per target, rewritten for each input: no disk I/O, nothing left behind.
class MemFile {
 public:
  explicit MemFile(const char* name) : fd_(memfd_create(name, MFD_CLOEXEC)) {
    if (fd_ < 0) {
      std::perror("memfd_create");
      std::abort();
    }
    path_ = "/proc/self/fd/" + std::to_string(fd_);
  }
  ~MemFile() { ::close(fd_); }
  MemFile(const MemFile&) = delete;
  MemFile& operator=(const MemFile&) = delete;

  // Replaces the content; returns the path to open.
  const std::string& write(const void* data, size_t size) {
    if (ftruncate(fd_, 0) != 0) std::abort();
    const auto* p = static_cast<const char*>(data);
    for (size_t done = 0; done < size;) {
      const ssize_t n = pwrite(fd_, p + done, size - done, static_cast<off_t>(done));
      if (n <= 0) std::abort();
      done += static_cast<size_t>(n);
    }
    return path_;
  }
  const std::string& write(std::string_view text) { return write(text.data(), text.size()); }
  const std::string& path() const { return path_; }

 private:
  int fd_;
  std::string path_;
};

// A check on a result the engine accepted; failing it is a finding.
#define MOE_FUZZ_CHECK(cond)                                                                 \
  do {                                                                                       \
    if (!(cond)) {                                                                           \
      std::fprintf(stderr, "%s:%d: fuzz invariant failed: %s\n", __FILE__, __LINE__, #cond); \
      std::abort();                                                                          \
    }                                                                                        \
  } while (0)

}  // namespace moe_fuzz
