// Fuzz target: a safetensors file (the 8-byte header length, the JSON header, the data section),
// loaded as the engine loads model weights: Checkpoint::open on a path (here an in-memory file),
// which maps the file and validates the whole header; then every tensor is read back (get, f32
// conversion) and the checkpoint fingerprinted, so that the validated offsets are exercised too.
#include <cstddef>
#include <cstdint>

#include "fuzz_util.h"
#include "moe/safetensors.h"

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  moe_fuzz::init_glib();
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static moe_fuzz::MemFile file("model.safetensors");
  const std::string& path = file.write(data, size);
  try {
    const moe::Checkpoint ckpt = moe::Checkpoint::open(path);
    for (const std::string& name : ckpt.names()) {
      const moe::Tensor t = ckpt.get(name);
      MOE_FUZZ_CHECK(t.numel() >= 0);
      try {
        const moe::Tensor f = t.to_f32();
        MOE_FUZZ_CHECK(f.numel() == t.numel());
      } catch (const moe::Error&) {
        // dtypes without an f32 conversion
      }
    }
    MOE_FUZZ_CHECK(ckpt.fingerprint().size() == 16);
  } catch (const moe::Error&) {
  }
  return 0;
}
