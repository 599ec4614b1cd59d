// Fuzz target: an index's item table (INDEX.items.jsonl), through parse_ann_pair_seal and
// parse_ann_item_table, the parsers AnnIndex::load runs on the file's text. The index it must describe comes from the
// input's last three bytes (libFuzzer's FuzzedDataProvider reads integers from the end): item count 0..8 (the last
// byte), dimension 1..16, flat or HNSW; the rest is the table's text.
#include <fuzzer/FuzzedDataProvider.h>

#include <cstddef>
#include <cstdint>
#include <string>

#include "fuzz_util.h"
#include "moe/catalog.h"

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  moe_fuzz::init_glib();
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  FuzzedDataProvider in(data, size);
  const int64_t count = in.ConsumeIntegralInRange<int64_t>(0, 8);
  const int dim = in.ConsumeIntegralInRange<int>(1, 16);
  const moe::AnnIndexType type = in.ConsumeBool() ? moe::AnnIndexType::Hnsw : moe::AnnIndexType::Flat;
  const std::string text = in.ConsumeRemainingBytesAsString();
  try {
    moe::parse_ann_pair_seal(text, "fuzz.faiss.items.jsonl");
  } catch (const moe::Error&) {
  }
  try {
    const moe::AnnItemTable table =
        moe::parse_ann_item_table(text, "fuzz.faiss.items.jsonl", "fuzz.faiss", count, dim, type);
    MOE_FUZZ_CHECK(static_cast<int64_t>(table.items.size()) == count);
    if (table.provenance) MOE_FUZZ_CHECK(!table.provenance->encoder_fingerprint.empty());
  } catch (const moe::Error&) {
  }
  return 0;
}
