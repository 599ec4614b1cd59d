/**
 * SECTION:element-moe-catalog-src
 * @title: moe-catalog-src
 * @see_also: moe-encode, ann-query
 *
 * moe-catalog-src reads an image catalog and sends one application/x-moe-request buffer per
 * item, as zmq-query sends image requests: the image file's bytes, with a GstMoeBatchMeta row
 * giving the item's id, its file:// uri and its caption (which ann-query stores with the item
 * when it builds an index). `location` is a folder of images (taken in name order; with
 * `recursive`, its subfolders' too), one image file, or a JSON Lines catalog, one {"path": ...,
 * "caption": ..., "id": ...} per line; a folder holding a catalog.jsonl means that catalog. What a
 * folder holds besides images (other files; subfolders, unless `recursive`) is skipped with one
 * warning message naming them. The element answers duration queries in items (GST_FORMAT_DEFAULT),
 * which ann-query's build progress uses as its total.
 *
 * An item that cannot be read (a missing file, a malformed catalog line) does not stop the build:
 * it travels on as a failed request (an empty buffer whose meta carries it), and ann-query
 * reports it like any other.
 *
 * The `stats` property counts, since the element started, the items of the catalog, those sent as
 * image requests, those sent as failed requests and the folder entries skipped.
 *
 * ## Example launch lines
 * |[
 * gst-launch-1.0 moe-catalog-src location=models/default/catalog \
 *     ! moe-encode model=models/default/clip max-batch=32 \
 *     ! moe-route model=models/default/adapter ! moe-expert model=models/default/adapter \
 *     ! ann-query mode=build index=/tmp/catalog.faiss ! fakesink
 * ]| Builds an index of the demo catalog, /tmp/catalog.faiss and its item table
 * (pipelines/build-index.sh runs this pipeline).
 * |[
 * gst-launch-1.0 -v moe-catalog-src location=models/default/catalog num-buffers=3 \
 *     ! fakesink silent=false
 * ]| Prints the first three request buffers of the demo catalog (size, offset, meta).
 */

/* Why a source of requests: building a search index means encoding every catalog image once;
 * sending them to moe-encode the way query images arrive makes both go through the same decoder
 * and encoder. The catalog is read (listed, or parsed line by line by the engine) when the
 * element starts; create() then sends one item per call, in the streaming thread, and reads the
 * image file there.
 */
#include "gstmoecatalogsrc.h"

#include <sys/stat.h>

#include <algorithm>
#include <memory>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "gstmoemeta.h"
#include "moe/catalog.h"
#include "moe/error.h"
#include "moe/query_request.h"
#include "moe/image_decode.h"

GST_DEBUG_CATEGORY_STATIC(gst_moe_catalog_src_debug);
#define GST_CAT_DEFAULT gst_moe_catalog_src_debug

enum { PROP_0, PROP_LOCATION, PROP_RECURSIVE, PROP_STATS };

#define DEFAULT_LOCATION nullptr
#define DEFAULT_RECURSIVE FALSE

namespace {

constexpr const char* kStage = "moe-catalog-src";
constexpr const char* kCatalogName = "catalog.jsonl";
constexpr const char* kImageExtensions[] = {"png", "jpg", "jpeg", "bmp",  "gif", "ppm",
                                            "pgm", "pbm", "pnm",  "webp", "tif", "tiff"};
// Folder levels below `location` that recursive=true enters (a bound, should links make it deep).
constexpr int kMaxFolderDepth = 16;
// Skipped entries that the warning names (it counts all of them).
constexpr size_t kMaxNamedSkips = 20;

// id, absolute path, caption; `error` set for a malformed catalog line.
using CatalogItem = moe::CatalogEntry;

// What one run works with: created by start() from the catalog, deleted by stop(); create() uses
// it without a lock.
struct CatalogState {
  std::vector<CatalogItem> items;
  size_t next = 0;  // the item create() sends next
};

}  // namespace

struct _GstMoeCatalogSrc {
  GstPushSrc parent;

  // Properties, under the object lock; read when the element starts.
  gchar* location;  // nullptr: unset
  gboolean recursive;

  // Behind `stats`, under the object lock: reset at start, kept after stop.
  guint64 items;    // in the catalog read at start
  guint64 sent;     // items sent as image requests
  guint64 failed;   // items sent as failed requests
  guint64 skipped;  // folder entries left out: not images, subfolders (unless recursive), loops

  // Between start() and stop(), nullptr otherwise (see CatalogState).
  CatalogState* state;
};

static GstStaticPadTemplate src_template =
    GST_STATIC_PAD_TEMPLATE("src", GST_PAD_SRC, GST_PAD_ALWAYS, GST_STATIC_CAPS(GST_MOE_REQUEST_CAPS));

#define gst_moe_catalog_src_parent_class parent_class
G_DEFINE_TYPE_WITH_CODE(GstMoeCatalogSrc, gst_moe_catalog_src, GST_TYPE_PUSH_SRC,
                        GST_DEBUG_CATEGORY_INIT(gst_moe_catalog_src_debug, "moe-catalog-src", 0,
                                                "image catalog source"));
GST_ELEMENT_REGISTER_DEFINE(moe_catalog_src, "moe-catalog-src", GST_RANK_NONE, GST_TYPE_MOE_CATALOG_SRC);

/* ----- properties ----- */

static void gst_moe_catalog_src_set_property(GObject* object, guint prop_id, const GValue* value, GParamSpec* pspec) {
  GstMoeCatalogSrc* self = GST_MOE_CATALOG_SRC(object);
  bool refused = false;
  GST_OBJECT_LOCK(self);
  switch (prop_id) {
    case PROP_LOCATION: {
      // GStreamer does not enforce MUTABLE_READY: without this, the property would name another
      // catalog than the one being sent.
      if (GST_STATE(self) > GST_STATE_READY) {
        refused = true;
        break;
      }
      const gchar* location = g_value_get_string(value);
      g_free(self->location);
      self->location = location && *location ? g_strdup(location) : nullptr;
      break;
    }
    case PROP_RECURSIVE:
      if (GST_STATE(self) > GST_STATE_READY)
        refused = true;
      else
        self->recursive = g_value_get_boolean(value);
      break;
    default:
      G_OBJECT_WARN_INVALID_PROPERTY_ID(object, prop_id, pspec);
      break;
  }
  GST_OBJECT_UNLOCK(self);
  if (refused)
    g_warning("moe-catalog-src: changing '%s' is only possible in the NULL or READY state",
              g_param_spec_get_name(pspec));
}

static void gst_moe_catalog_src_get_property(GObject* object, guint prop_id, GValue* value, GParamSpec* pspec) {
  GstMoeCatalogSrc* self = GST_MOE_CATALOG_SRC(object);
  GST_OBJECT_LOCK(self);
  switch (prop_id) {
    case PROP_LOCATION:
      g_value_set_string(value, self->location);
      break;
    case PROP_RECURSIVE:
      g_value_set_boolean(value, self->recursive);
      break;
    case PROP_STATS:
      g_value_take_boxed(value, gst_structure_new("moe-catalog-src-stats", "items", G_TYPE_UINT64, self->items, "sent",
                                                  G_TYPE_UINT64, self->sent, "failed", G_TYPE_UINT64, self->failed,
                                                  "skipped", G_TYPE_UINT64, self->skipped, nullptr));
      break;
    default:
      G_OBJECT_WARN_INVALID_PROPERTY_ID(object, prop_id, pspec);
      break;
  }
  GST_OBJECT_UNLOCK(self);
}

/* ----- reading the catalog ----- */

static std::string take_string(gchar* s) {
  std::string out = s != nullptr ? s : "";
  g_free(s);
  return out;
}

static bool has_image_extension(const std::string& name) {
  const size_t dot = name.rfind('.');
  if (dot == std::string::npos) return false;
  const std::string ext = take_string(g_ascii_strdown(name.c_str() + dot + 1, -1));
  return std::any_of(std::begin(kImageExtensions), std::end(kImageExtensions), [&](const char* e) { return ext == e; });
}

// What listing a folder found besides its images, for the warning that names them.
struct Skipped {
  size_t count = 0;
  std::vector<std::string> named;  // the first kMaxNamedSkips, "<relative path> (<why>)"
  void add(const std::string& what) {
    if (named.size() < kMaxNamedSkips) named.push_back(what);
    ++count;
  }
};

// Lists the images under `dir` (its path below the location is `relative`, "" at the top), in
// name order, into `items`: subfolders too when `recursive`, down to kMaxFolderDepth levels and
// never a folder twice (`visited`: device and inode of the folders entered, so symlink loops end).
// What it leaves out goes to `skipped`. Returns false with `error` set if `dir` cannot be listed
// (a subfolder that cannot be listed is skipped instead).
static bool list_folder(const std::string& dir, const std::string& relative, bool recursive, int depth,
                        std::set<std::pair<dev_t, ino_t>>* visited, std::vector<CatalogItem>* items, Skipped* skipped,
                        std::string* error) {
  struct stat st;
  if (stat(dir.c_str(), &st) == 0 && !visited->insert({st.st_dev, st.st_ino}).second) {
    skipped->add(relative + "/ (already listed: a symlink loop or a second link to it)");
    return true;
  }
  GError* err = nullptr;
  GDir* d = g_dir_open(dir.c_str(), 0, &err);
  if (d == nullptr) {
    *error = err->message;
    g_error_free(err);
    return false;
  }
  std::vector<std::string> names;
  while (const gchar* name = g_dir_read_name(d)) names.emplace_back(name);
  g_dir_close(d);
  std::sort(names.begin(), names.end());
  for (const std::string& name : names) {
    const std::string path = take_string(g_build_filename(dir.c_str(), name.c_str(), nullptr));
    const std::string shown = relative.empty() ? name : relative + "/" + name;
    if (g_file_test(path.c_str(), G_FILE_TEST_IS_DIR)) {
      if (!recursive) {
        skipped->add(shown + "/ (a subfolder: set recursive=true to index subfolders)");
      } else if (depth >= kMaxFolderDepth) {
        skipped->add(shown + "/ (deeper than " + std::to_string(kMaxFolderDepth) + " folder levels)");
      } else {
        std::string sub_error;
        if (!list_folder(path, shown, recursive, depth + 1, visited, items, skipped, &sub_error))
          skipped->add(shown + "/ (cannot be listed: " + sub_error + ")");
      }
    } else if (!has_image_extension(name)) {
      skipped->add(shown + " (not an image file by its extension)");
    } else if (!g_file_test(path.c_str(), G_FILE_TEST_IS_REGULAR)) {
      skipped->add(shown + " (not a regular file)");
    } else {
      CatalogItem item;
      item.path = path;
      // Below the top folder the id keeps the folder names: a/cat.jpg and b/cat.jpg are two items.
      item.id = moe::catalog_id_from_path(name);
      if (!relative.empty()) item.id = relative + "/" + item.id;
      items->push_back(std::move(item));
    }
  }
  return true;
}

// The items of a JSONL catalog. Returns false with `error` set if the file cannot be read.
static bool read_catalog(const std::string& file, std::vector<CatalogItem>* items, std::string* error) {
  gchar* text = nullptr;
  gsize size = 0;
  GError* err = nullptr;
  if (!g_file_get_contents(file.c_str(), &text, &size, &err)) {
    *error = err->message;
    g_error_free(err);
    return false;
  }
  const std::string folder = take_string(g_path_get_dirname(file.c_str()));
  const std::string all(text, size);
  g_free(text);
  size_t start = 0;
  for (int line_no = 1; start < all.size(); ++line_no) {
    size_t end = all.find('\n', start);
    if (end == std::string::npos) end = all.size();
    const std::string line = all.substr(start, end - start);
    start = end + 1;
    if (line.find_first_not_of(" \t\r") == std::string::npos) continue;  // blank lines
    // One {"path": ..., "caption": ..., "id": ...} object: parsed by the engine (bounded JSON).
    items->push_back(moe::parse_catalog_line(line, folder, "catalog '" + file + "' line " + std::to_string(line_no)));
  }
  return true;
}

/* ----- start/stop ----- */

// Reads the catalog: a failure to find or read it is an element error; its bad items are not.
static gboolean gst_moe_catalog_src_start(GstBaseSrc* src) {
  GstMoeCatalogSrc* self = GST_MOE_CATALOG_SRC(src);
  GST_OBJECT_LOCK(self);
  const std::string location = self->location ? self->location : "";
  const bool recursive = self->recursive;
  self->items = self->sent = self->failed = self->skipped = 0;
  GST_OBJECT_UNLOCK(self);

  if (location.empty()) {
    GST_ELEMENT_ERROR(self, RESOURCE, NOT_FOUND,
                      ("No catalog location set: set 'location' to a folder, an image file or a .jsonl file"),
                      (nullptr));
    return FALSE;
  }
  const std::string path = take_string(g_canonicalize_filename(location.c_str(), nullptr));
  if (!g_file_test(path.c_str(), G_FILE_TEST_EXISTS)) {
    GST_ELEMENT_ERROR(self, RESOURCE, NOT_FOUND, ("Catalog location '%s' does not exist", location.c_str()), (nullptr));
    return FALSE;
  }
  auto state = std::make_unique<CatalogState>();
  std::string file = path;  // what was read, for messages
  bool ok;
  std::string error;
  Skipped skipped;
  if (g_file_test(path.c_str(), G_FILE_TEST_IS_DIR)) {
    const std::string catalog = take_string(g_build_filename(path.c_str(), kCatalogName, nullptr));
    if (g_file_test(catalog.c_str(), G_FILE_TEST_EXISTS)) {
      file = catalog;
      ok = read_catalog(catalog, &state->items, &error);
    } else {
      std::set<std::pair<dev_t, ino_t>> visited;
      ok = list_folder(path, "", recursive, 0, &visited, &state->items, &skipped, &error);
    }
  } else if (has_image_extension(path)) {
    // One image: the user means that image, not a catalog in an unusual file.
    CatalogItem item;
    item.path = path;
    item.id = moe::catalog_id_from_path(path);
    state->items.push_back(std::move(item));
    ok = true;
  } else {
    ok = read_catalog(path, &state->items, &error);
  }
  if (!ok) {
    GST_ELEMENT_ERROR(self, RESOURCE, OPEN_READ, ("Cannot read the catalog '%s': %s", file.c_str(), error.c_str()),
                      (nullptr));
    return FALSE;
  }
  GST_INFO_OBJECT(self, "%zu catalog items from %s", state->items.size(), file.c_str());
  if (skipped.count > 0) {
    // Said where users look (gst-launch prints warnings): a file left out silently looks indexed.
    std::string names;
    for (const std::string& s : skipped.named) names += "\n  " + s;
    if (skipped.count > skipped.named.size())
      names += "\n  ... and " + std::to_string(skipped.count - skipped.named.size()) + " more";
    GST_ELEMENT_WARNING(self, RESOURCE, READ,
                        ("Skipped %zu entries of the folder '%s' (indexing its %zu images):%s", skipped.count,
                         path.c_str(), state->items.size(), names.c_str()),
                        (nullptr));
  }
  GST_OBJECT_LOCK(self);
  self->items = state->items.size();
  self->skipped = skipped.count;
  self->state = state.release();
  GST_OBJECT_UNLOCK(self);
  return TRUE;
}

static gboolean gst_moe_catalog_src_stop(GstBaseSrc* src) {
  GstMoeCatalogSrc* self = GST_MOE_CATALOG_SRC(src);
  GST_OBJECT_LOCK(self);
  CatalogState* state = self->state;
  self->state = nullptr;
  GST_OBJECT_UNLOCK(self);
  delete state;
  return TRUE;
}

// Answers the duration in items (GST_FORMAT_DEFAULT) once the catalog is read: an index build
// downstream (ann-query) reports its progress against it.
static gboolean gst_moe_catalog_src_query(GstBaseSrc* src, GstQuery* query) {
  GstMoeCatalogSrc* self = GST_MOE_CATALOG_SRC(src);
  if (GST_QUERY_TYPE(query) == GST_QUERY_DURATION) {
    GstFormat format;
    gst_query_parse_duration(query, &format, nullptr);
    if (format == GST_FORMAT_DEFAULT) {
      GST_OBJECT_LOCK(self);
      const bool known = self->state != nullptr;
      const guint64 items = self->items;
      GST_OBJECT_UNLOCK(self);
      if (!known) return FALSE;
      gst_query_set_duration(query, format, static_cast<gint64>(items));
      return TRUE;
    }
  }
  return GST_BASE_SRC_CLASS(parent_class)->query(src, query);
}

/* ----- items ----- */

// One item as a request buffer, or as a failed request when it cannot be read.
static GstFlowReturn gst_moe_catalog_src_create(GstPushSrc* src, GstBuffer** out) {
  GstMoeCatalogSrc* self = GST_MOE_CATALOG_SRC(src);
  CatalogState* st = self->state;
  if (st->next >= st->items.size()) return GST_FLOW_EOS;
  const guint64 index = st->next++;
  const CatalogItem& item = st->items[index];

  gstmoe::RequestRecord request;
  request.id = item.id;
  request.modality = gstmoe::Modality::Image;
  request.text = item.caption;
  request.fields = item.fields;  // the catalog line's other members travel into the index
  if (!item.path.empty()) request.uri = take_string(g_filename_to_uri(item.path.c_str(), nullptr, nullptr));
  request.arrival_wall_us = g_get_real_time();
  request.arrival_mono_us = g_get_monotonic_time();

  gstmoe::BatchRecords records;
  std::string error = item.error;
  GstBuffer* buf = nullptr;
  if (error.empty()) {
    try {
      buf = gstmoe::bytes_buffer(moe::read_image_file(item.path));
      records.rows.push_back(std::move(request));
    } catch (const moe::Error& e) {
      error = e.what();
    }
  }
  if (!error.empty()) {
    GST_WARNING_OBJECT(self, "item %" G_GUINT64_FORMAT " skipped: %s", index, error.c_str());
    buf = gst_buffer_new();
    records.failed.push_back(
        {std::move(request), kStage, error,
         item.error.empty() ? moe::error_code::kImageUnavailable : moe::error_code::kInvalidRequest});
  }
  GST_OBJECT_LOCK(self);
  if (error.empty())
    ++self->sent;
  else
    ++self->failed;
  GST_OBJECT_UNLOCK(self);
  GST_BUFFER_OFFSET(buf) = index;
  GST_BUFFER_OFFSET_END(buf) = index + 1;
  gst_buffer_add_moe_batch_meta(buf, records);
  *out = buf;
  return GST_FLOW_OK;
}

/* ----- GObject ----- */

static void gst_moe_catalog_src_finalize(GObject* object) {
  GstMoeCatalogSrc* self = GST_MOE_CATALOG_SRC(object);
  g_free(self->location);
  delete self->state;  // only set if the element was disposed without stopping
  G_OBJECT_CLASS(parent_class)->finalize(object);
}

static void gst_moe_catalog_src_class_init(GstMoeCatalogSrcClass* klass) {
  GObjectClass* gobject_class = G_OBJECT_CLASS(klass);
  GstElementClass* element_class = GST_ELEMENT_CLASS(klass);
  GstBaseSrcClass* basesrc_class = GST_BASE_SRC_CLASS(klass);
  GstPushSrcClass* pushsrc_class = GST_PUSH_SRC_CLASS(klass);
  gobject_class->set_property = gst_moe_catalog_src_set_property;
  gobject_class->get_property = gst_moe_catalog_src_get_property;
  gobject_class->finalize = gst_moe_catalog_src_finalize;

  g_object_class_install_property(
      gobject_class, PROP_LOCATION,
      g_param_spec_string(
          "location", "Location",
          "A folder of images (png, jpg, jpeg, bmp, gif, ppm, webp, tif, tiff; taken in name order; its catalog.jsonl "
          "instead when it has one; other files and subfolders are skipped with a warning naming them, unless "
          "'recursive'), one image file (by its extension), or a JSON Lines catalog: one {\"path\": ..., "
          "\"caption\": ..., \"id\": ...} per line, paths relative to the catalog's folder, id defaulting to the file "
          "name without extension (below the top folder, with its folder: sub/cat)",
          DEFAULT_LOCATION, gstmoe::kPropertyMutableReady));
  g_object_class_install_property(
      gobject_class, PROP_RECURSIVE,
      g_param_spec_boolean("recursive", "Recursive",
                           "When 'location' is a folder without a catalog.jsonl, also index the images of its "
                           "subfolders, in name order, down to 16 levels; a folder reached twice (a symlink loop) is "
                           "listed once",
                           DEFAULT_RECURSIVE, gstmoe::kPropertyMutableReady));
  g_object_class_install_property(
      gobject_class, PROP_STATS,
      gstmoe::stats_param_spec("moe-catalog-src-stats, since the element started: items (in the catalog), sent (items "
                               "sent as image requests), failed (items sent as failed requests: a malformed catalog "
                               "line, or an image file that cannot be read), skipped (folder entries left out: files "
                               "without an image extension, subfolders unless recursive, folders reached twice)"));

  gst_element_class_add_static_pad_template(element_class, &src_template);
  gst_element_class_set_static_metadata(
      element_class, "Image catalog source", "Source/File",
      "Reads an image catalog (a folder of images or a JSON Lines file) and emits one application/x-moe-request "
      "buffer per item: the image file's bytes, with a GstMoeBatchMeta row giving its id, file:// uri and caption. "
      "Unreadable items travel on as failed requests. Example: gst-launch-1.0 moe-catalog-src "
      "location=models/default/catalog ! moe-encode model=models/default/clip max-batch=32 ! fakesink",
      "gst-moe developers");

  basesrc_class->start = GST_DEBUG_FUNCPTR(gst_moe_catalog_src_start);
  basesrc_class->stop = GST_DEBUG_FUNCPTR(gst_moe_catalog_src_stop);
  basesrc_class->query = GST_DEBUG_FUNCPTR(gst_moe_catalog_src_query);
  pushsrc_class->create = GST_DEBUG_FUNCPTR(gst_moe_catalog_src_create);
}

static void gst_moe_catalog_src_init(GstMoeCatalogSrc* self) {
  self->location = g_strdup(DEFAULT_LOCATION);
  self->recursive = DEFAULT_RECURSIVE;
  self->items = self->sent = self->failed = self->skipped = 0;
  self->state = nullptr;
  // Buffers count items, not bytes or time.
  gst_base_src_set_format(GST_BASE_SRC(self), GST_FORMAT_DEFAULT);
}
