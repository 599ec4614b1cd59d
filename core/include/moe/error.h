// gst-moe: the one exception type the engine throws.
#pragma once

#include <stdexcept>
#include <string>

namespace moe {

// Every engine failure (bad model file, wrong shape, invalid text...) is a moe::Error whose
// message names the thing (file, tensor, field) and the reason, so callers can show it as is.
class Error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

}  // namespace moe
