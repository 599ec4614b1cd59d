#include "moe/safetensors.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <limits>
#include <mutex>
#include <set>
#include <string_view>

#include "io/json_util.h"
#include "moe/error.h"

namespace moe {

namespace {

struct MappedFile {
  void* addr = nullptr;
  size_t size = 0;
  ~MappedFile() {
    if (addr && size) munmap(addr, size);
  }
};

bool parse_dtype(const std::string& s, DType* out) {
  static const std::pair<const char*, DType> table[] = {
      {"F32", DType::F32}, {"F16", DType::F16}, {"BF16", DType::BF16}, {"I64", DType::I64},
      {"I32", DType::I32}, {"I8", DType::I8},   {"U8", DType::U8},
  };
  for (const auto& [name, dt] : table) {
    if (s == name) {
      *out = dt;
      return true;
    }
  }
  return false;
}

bool is_directory(const std::string& path) {
  struct stat st {};
  return stat(path.c_str(), &st) == 0 && S_ISDIR(st.st_mode);
}

bool is_file(const std::string& path) {
  struct stat st {};
  return stat(path.c_str(), &st) == 0 && S_ISREG(st.st_mode);
}

std::string dirname_of(const std::string& path) {
  const auto slash = path.find_last_of('/');
  return slash == std::string::npos ? "." : path.substr(0, slash);
}

bool ends_with(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() && s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

// The first string of a (valid) JSON text that holds an escaped NUL (\u0000), as written, or "".
// JSON-GLib ends a string at the NUL: tensor "a\u0000b" would silently become tensor 'a'.
std::string string_with_nul(std::string_view json) {
  for (size_t i = 0; i < json.size(); ++i) {
    if (json[i] != '"') continue;  // outside strings, valid JSON has no quote or backslash
    const size_t begin = i;
    bool nul = false;
    for (++i; i < json.size() && json[i] != '"'; ++i) {
      if (json[i] != '\\') continue;
      nul = nul || json.compare(i + 1, 5, "u0000") == 0;
      ++i;  // the escaped character: \" does not end the string
    }
    if (nul) return std::string(json.substr(begin, i + 1 - begin));
  }
  return "";
}

// Every member of every object, as the parser reads it, and the first key an object repeats.
struct KeysSeen {
  std::map<JsonObject*, std::set<std::string>> keys;
  JsonObject* repeated_in = nullptr;
  std::string repeated;
};

void on_object_member(JsonParser*, JsonObject* object, const gchar* name, gpointer data) {
  auto* seen = static_cast<KeysSeen*>(data);
  if (!seen->keys[object].insert(name).second && seen->repeated_in == nullptr) {
    seen->repeated_in = object;
    seen->repeated = name;
  }
}

// Where a JSON object text, already accepted by json::Document (valid, within its bounds),
// repeats a key: "key 'k' appears more than once in <where>", or "". JSON-GLib keeps the last
// value of a repeated key without a word, so the text is parsed again with the parser's
// "object-member" signal watched, which fires for each member as written.
std::string repeated_key(std::string_view json) {
  KeysSeen seen;
  JsonParser* parser = json_parser_new();
  g_signal_connect(parser, "object-member", G_CALLBACK(on_object_member), &seen);
  std::string found;
  if (json_parser_load_from_data(parser, json.data(), static_cast<gssize>(json.size()), nullptr) &&
      seen.repeated_in != nullptr) {
    JsonObject* root = json_node_get_object(json_parser_get_root(parser));
    std::string where = seen.repeated_in == root ? "the header" : "an object of the header";
    GList* members = json_object_get_members(root);
    for (GList* it = members; it; it = it->next) {
      JsonNode* node = json_object_get_member(root, static_cast<const char*>(it->data));
      if (JSON_NODE_HOLDS_OBJECT(node) && json_node_get_object(node) == seen.repeated_in)
        where = "'" + std::string(static_cast<const char*>(it->data)) + "'";
    }
    g_list_free(members);
    found = "key '" + seen.repeated + "' appears more than once in " + where;
  }
  g_object_unref(parser);
  return found;
}

// The data section must be exactly the tensors' bytes, as the format's reference implementation
// requires (InvalidOffset, MetadataIncompleteBuffer): sorted by offset, each non-empty tensor
// begins where the previous one ends, the first at 0, the last at the section's end; an empty
// tensor holds no bytes but lies between tensors, not inside one.
void check_data_layout(const std::string& p, std::vector<const TensorInfo*> tensors, uint64_t data_size) {
  std::sort(tensors.begin(), tensors.end(), [](const TensorInfo* a, const TensorInfo* b) {
    return a->begin != b->begin ? a->begin < b->begin : a->end < b->end;
  });
  auto bytes = [](const TensorInfo* t) {
    return "'" + t->name + "' (bytes " + std::to_string(t->begin) + ".." + std::to_string(t->end) + ")";
  };
  uint64_t covered = 0;
  const TensorInfo* prev = nullptr;  // the last non-empty tensor
  for (const TensorInfo* t : tensors) {
    if (t->begin == t->end) continue;
    if (t->begin < covered)
      throw Error(p + ": tensors " + bytes(prev) + " and " + bytes(t) + " overlap in the data section");
    if (t->begin > covered)
      throw Error(p + ": bytes " + std::to_string(covered) + ".." + std::to_string(t->begin) +
                  " of the data section belong to no tensor (a gap before tensor " + bytes(t) + ")");
    covered = t->end;
    prev = t;
  }
  if (covered != data_size)
    throw Error(p + ": bytes " + std::to_string(covered) + ".." + std::to_string(data_size) +
                " at the end of the data section belong to no tensor");
  prev = nullptr;
  for (const TensorInfo* t : tensors) {
    if (t->begin != t->end)
      prev = t;
    else if (prev != nullptr && t->begin < prev->end)
      throw Error(p + ": empty tensor '" + t->name + "' at byte " + std::to_string(t->begin) + " lies inside tensor " +
                  bytes(prev));
  }
}

// 64-bit FNV-1a: tiny, dependency-free and well spread; the fingerprint needs no cryptographic
// strength, only that different weights give different values.
class Fnv1a64 {
 public:
  void bytes(const void* data, size_t n) {
    const auto* p = static_cast<const uint8_t*>(data);
    for (size_t i = 0; i < n; ++i) h_ = (h_ ^ p[i]) * 0x100000001b3ull;
  }
  // Fixed-width little-endian, so that the value is the same on every machine.
  void u64(uint64_t v) {
    uint8_t le[8];
    for (int i = 0; i < 8; ++i) le[i] = static_cast<uint8_t>(v >> (8 * i));
    bytes(le, sizeof le);
  }
  // Length first, so that adjacent strings cannot trade characters.
  void str(const std::string& s) {
    u64(s.size());
    bytes(s.data(), s.size());
  }
  std::string hex() const {
    char out[17];
    std::snprintf(out, sizeof out, "%016llx", static_cast<unsigned long long>(h_));
    return out;
  }

 private:
  uint64_t h_ = 0xcbf29ce484222325ull;
};

}  // namespace

SafetensorsFile SafetensorsFile::open(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) throw Error(path + ": cannot open: " + std::strerror(errno));
  struct stat st {};
  if (fstat(fd, &st) != 0) {
    const int e = errno;
    ::close(fd);
    throw Error(path + ": cannot stat: " + std::strerror(e));
  }
  if (!S_ISREG(st.st_mode)) {
    ::close(fd);
    throw Error(path + ": not a regular file");
  }
  auto mapped = std::make_shared<MappedFile>();
  mapped->size = static_cast<size_t>(st.st_size);
  if (mapped->size > 0) {
    mapped->addr = mmap(nullptr, mapped->size, PROT_READ, MAP_PRIVATE, fd, 0);
    if (mapped->addr == MAP_FAILED) {
      const int e = errno;
      mapped->addr = nullptr;
      ::close(fd);
      throw Error(path + ": mmap failed: " + std::strerror(e));
    }
  }
  ::close(fd);
  const auto* bytes = static_cast<const uint8_t*>(mapped->addr);
  const size_t size = mapped->size;
  return parse(bytes, size, std::move(mapped), path);
}

SafetensorsFile SafetensorsFile::parse(const uint8_t* data, size_t size, std::shared_ptr<const void> owner,
                                       std::string name) {
  SafetensorsFile f;
  f.path_ = std::move(name);
  f.owner_ = std::move(owner);
  const std::string& p = f.path_;
  if (size < 8) throw Error(p + ": truncated: " + std::to_string(size) + " bytes, no header length");
  uint64_t header_len = 0;
  for (int i = 7; i >= 0; --i) header_len = (header_len << 8) | data[i];  // little endian
  if (header_len > kMaxHeaderBytes)
    throw Error(p + ": header length " + std::to_string(header_len) + " exceeds the " +
                std::to_string(kMaxHeaderBytes) + "-byte limit");
  if (header_len > size - 8)
    throw Error(p + ": truncated: header length " + std::to_string(header_len) + " but only " +
                std::to_string(size - 8) + " bytes follow");
  const uint64_t data_size = size - 8 - header_len;
  f.data_section_ = data + 8 + header_len;

  const char* header = reinterpret_cast<const char*>(data + 8);
  if (!g_utf8_validate(header, static_cast<gssize>(header_len), nullptr))
    throw Error(p + ": header is not valid UTF-8");
  const std::string_view header_text(header, header_len);
  json::Document doc(header_text, p + " header");
  JsonObject* root = doc.root_object();
  const std::string nul = string_with_nul(header_text);
  if (!nul.empty())
    throw Error(p + ": header string " + nul +
                " holds a NUL character, which no tensor name, dtype or metadata string may hold");
  const std::string repeated = repeated_key(header_text);
  if (!repeated.empty()) throw Error(p + ": " + repeated);

  GList* members = json_object_get_members(root);
  for (GList* it = members; it; it = it->next) {
    const std::string key = static_cast<const char*>(it->data);
    JsonNode* node = json_object_get_member(root, key.c_str());
    if (key == "__metadata__") {
      if (!JSON_NODE_HOLDS_OBJECT(node)) {
        g_list_free(members);
        throw Error(p + ": __metadata__ is not an object");
      }
      JsonObject* meta = json_node_get_object(node);
      GList* mk = json_object_get_members(meta);
      for (GList* m = mk; m; m = m->next) {
        JsonNode* v = json_object_get_member(meta, static_cast<const char*>(m->data));
        if (!JSON_NODE_HOLDS_VALUE(v) || json_node_get_value_type(v) != G_TYPE_STRING) {
          const std::string msg =
              p + ": __metadata__ value '" + static_cast<const char*>(m->data) + "' is not a string";
          g_list_free(mk);
          g_list_free(members);
          throw Error(msg);
        }
        f.metadata_[static_cast<const char*>(m->data)] = json_node_get_string(v);
      }
      g_list_free(mk);
      continue;
    }
    try {
      const std::string what = p + ": tensor '" + key + "'";
      if (!JSON_NODE_HOLDS_OBJECT(node)) throw Error(what + ": entry is not an object");
      JsonObject* obj = json_node_get_object(node);
      TensorInfo info;
      info.name = key;
      const std::string dt = json::get_string(obj, "dtype", what);
      if (!parse_dtype(dt, &info.dtype)) throw Error(what + ": unsupported dtype '" + dt + "'");
      JsonNode* shape_node = json_object_get_member(obj, "shape");
      if (!shape_node || !JSON_NODE_HOLDS_ARRAY(shape_node)) throw Error(what + ": missing shape array");
      JsonArray* shape = json_node_get_array(shape_node);
      // Limit the element count so numel * size cannot overflow before the range check.
      const int64_t kMaxElems = std::numeric_limits<int64_t>::max() / 16;
      int64_t numel = 1;
      for (guint i = 0; i < json_array_get_length(shape); ++i) {
        JsonNode* d = json_array_get_element(shape, i);
        if (!JSON_NODE_HOLDS_VALUE(d) || json_node_get_value_type(d) != G_TYPE_INT64)
          throw Error(what + ": shape entry " + std::to_string(i) + " is not an integer");
        const int64_t v = json_node_get_int(d);
        if (v < 0) throw Error(what + ": negative dimension " + std::to_string(v));
        if (v != 0 && numel > kMaxElems / v) throw Error(what + ": shape too large");
        numel *= v;
        info.shape.push_back(v);
      }
      JsonNode* off_node = json_object_get_member(obj, "data_offsets");
      if (!off_node || !JSON_NODE_HOLDS_ARRAY(off_node)) throw Error(what + ": missing data_offsets");
      JsonArray* offs = json_node_get_array(off_node);
      if (json_array_get_length(offs) != 2) throw Error(what + ": data_offsets must have 2 entries");
      int64_t be[2];
      for (guint i = 0; i < 2; ++i) {
        JsonNode* d = json_array_get_element(offs, i);
        if (!JSON_NODE_HOLDS_VALUE(d) || json_node_get_value_type(d) != G_TYPE_INT64 || json_node_get_int(d) < 0)
          throw Error(what + ": data_offsets entry is not a non-negative integer");
        be[i] = json_node_get_int(d);
      }
      info.begin = static_cast<uint64_t>(be[0]);
      info.end = static_cast<uint64_t>(be[1]);
      if (info.begin > info.end)
        throw Error(what + ": data_offsets begin " + std::to_string(info.begin) + " > end " + std::to_string(info.end));
      if (info.end > data_size)
        throw Error(what + ": data_offsets end " + std::to_string(info.end) + " is past the data section (" +
                    std::to_string(data_size) + " bytes)");
      const uint64_t want = dtype_storage_bytes(info.dtype, numel);
      if (info.end - info.begin != want)
        throw Error(what + ": shape " + shape_to_string(info.shape) + " of " + dt + " needs " + std::to_string(want) +
                    " bytes but data_offsets span " + std::to_string(info.end - info.begin));
      f.index_.emplace(key, std::move(info));
    } catch (...) {
      g_list_free(members);
      throw;
    }
  }
  g_list_free(members);

  std::vector<const TensorInfo*> tensors;
  for (const auto& [k, info] : f.index_) tensors.push_back(&info);
  check_data_layout(p, std::move(tensors), data_size);
  return f;
}

std::vector<std::string> SafetensorsFile::names() const {
  std::vector<std::string> out;
  out.reserve(index_.size());
  for (const auto& kv : index_) out.push_back(kv.first);
  std::sort(out.begin(), out.end());
  return out;
}

const TensorInfo& SafetensorsFile::info(const std::string& name) const {
  auto it = index_.find(name);
  if (it == index_.end()) throw Error(path_ + ": no tensor named '" + name + "'");
  return it->second;
}

Tensor SafetensorsFile::get(const std::string& name) const {
  const TensorInfo& i = info(name);
  // The mapping is read-only; Tensor's mutable pointer is never written for file views.
  void* ptr = const_cast<uint8_t*>(data_section_ + i.begin);
  Tensor view = Tensor::view(i.dtype, i.shape, ptr, owner_);
  // Writers pad the header to 8 bytes, but the format does not require it: copy a misaligned
  // tensor rather than hand out a pointer that typed access would misread.
  const size_t align = std::max<size_t>(1, dtype_storage_bytes(i.dtype, 1));
  if (reinterpret_cast<uintptr_t>(ptr) % align != 0) return view.clone();
  return view;
}

const uint8_t* SafetensorsFile::bytes(const std::string& name) const { return data_section_ + info(name).begin; }

// ---------------------------------------------------------------------------------------------

struct Checkpoint::Shard {
  std::string path;
  std::once_flag opened;
  std::unique_ptr<SafetensorsFile> file;
  const SafetensorsFile& get() {
    std::call_once(opened, [this] { file = std::make_unique<SafetensorsFile>(SafetensorsFile::open(path)); });
    return *file;
  }
};

Checkpoint Checkpoint::open(const std::string& path) {
  Checkpoint c;
  c.path_ = path;
  std::string target = path;
  if (is_directory(path)) {
    if (is_file(path + "/model.safetensors"))
      target = path + "/model.safetensors";
    else if (is_file(path + "/model.safetensors.index.json"))
      target = path + "/model.safetensors.index.json";
    else
      throw Error(path + ": no model.safetensors or model.safetensors.index.json in this directory");
  }
  if (ends_with(target, ".json")) {
    json::Document doc = json::Document::from_file(target);
    JsonObject* map = json::get_object_or_null(doc.root_object(), "weight_map", target);
    if (!map) throw Error(target + ": missing 'weight_map'");
    const std::string dir = dirname_of(target);
    std::unordered_map<std::string, size_t> shard_of_file;
    GList* members = json_object_get_members(map);
    for (GList* it = members; it; it = it->next) {
      const char* tensor = static_cast<const char*>(it->data);
      JsonNode* v = json_object_get_member(map, tensor);
      if (!JSON_NODE_HOLDS_VALUE(v) || json_node_get_value_type(v) != G_TYPE_STRING) {
        g_list_free(members);
        throw Error(target + ": weight_map entry '" + tensor + "' is not a file name");
      }
      const std::string file = json_node_get_string(v);
      if (file.find('/') != std::string::npos || file == "..") {
        g_list_free(members);
        throw Error(target + ": weight_map entry '" + tensor + "' names a path outside the checkpoint: " + file);
      }
      auto [pos, inserted] = shard_of_file.emplace(file, c.shards_.size());
      if (inserted) {
        auto shard = std::make_shared<Shard>();
        shard->path = dir + "/" + file;
        c.shards_.push_back(std::move(shard));
      }
      c.weight_map_[tensor] = pos->second;
    }
    g_list_free(members);
    if (c.shards_.empty()) throw Error(target + ": weight_map is empty");
    return c;
  }
  auto shard = std::make_shared<Shard>();
  shard->path = target;
  const SafetensorsFile& f = shard->get();
  for (const auto& n : f.names()) c.weight_map_[n] = 0;
  c.shards_.push_back(std::move(shard));
  return c;
}

std::vector<std::string> Checkpoint::names() const {
  std::vector<std::string> out;
  for (const auto& kv : weight_map_) out.push_back(kv.first);
  std::sort(out.begin(), out.end());
  return out;
}

bool Checkpoint::contains(const std::string& name) const { return weight_map_.count(name) != 0; }

std::string Checkpoint::file_of(const std::string& name) const {
  auto it = weight_map_.find(name);
  if (it == weight_map_.end()) throw Error(path_ + ": no tensor named '" + name + "'");
  return shards_[it->second]->path;
}

const SafetensorsFile& Checkpoint::shard_of(const std::string& name) const {
  auto it = weight_map_.find(name);
  if (it == weight_map_.end()) throw Error(path_ + ": no tensor named '" + name + "'");
  const SafetensorsFile& f = shards_[it->second]->get();
  if (!f.contains(name))
    throw Error(f.path() + ": tensor '" + name + "' listed in the index but missing from the shard");
  return f;
}

Tensor Checkpoint::get(const std::string& name) const { return shard_of(name).get(name); }

Tensor Checkpoint::get_f32(const std::string& name, const Shape& expected) const {
  Tensor t = get(name);
  if (t.shape() != expected)
    throw Error(file_of(name) + ": tensor '" + name + "' has shape " + shape_to_string(t.shape()) + ", expected " +
                shape_to_string(expected));
  if (t.dtype() == DType::I64 || t.dtype() == DType::I32 || t.dtype() == DType::I8 || t.dtype() == DType::U8)
    throw Error(file_of(name) + ": tensor '" + name + "' has integer dtype " + dtype_name(t.dtype()) +
                ", expected a floating-point weight");
  return t.to_f32();
}

std::string Checkpoint::fingerprint() const {
  constexpr size_t kSlice = kFingerprintSampleBytes / 3;
  Fnv1a64 h;
  for (const std::string& name : names()) {  // sorted: independent of file and shard order
    const SafetensorsFile& f = shard_of(name);
    const TensorInfo& info = f.info(name);
    h.str(name);
    h.str(dtype_name(info.dtype));
    h.u64(info.shape.size());
    for (int64_t d : info.shape) h.u64(static_cast<uint64_t>(d));
    const uint8_t* data = f.bytes(name);
    const size_t n = static_cast<size_t>(info.end - info.begin);
    if (n <= kFingerprintSampleBytes) {
      h.bytes(data, n);
    } else {
      h.bytes(data, kSlice);
      h.bytes(data + (n - kSlice) / 2, kSlice);
      h.bytes(data + n - kSlice, kSlice);
    }
  }
  return h.hex();
}

}  // namespace moe
