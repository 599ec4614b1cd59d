#include "moe/image_decode.h"

#include <gdk-pixbuf/gdk-pixbuf.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <mutex>
#include <string>

#include "moe/error.h"

namespace moe {

namespace {

// What the loader's signals tell while it decodes.
struct LoadProgress {
  int64_t width = 0, height = 0;
  bool size_known = false;
  bool too_big = false;
  std::vector<bool> rows_done;  // rows the loader reported as decoded
};

// Sees the canvas size as soon as the header is parsed, before any pixel memory exists. The PNM
// loader emits it again for every 4 KB it reads: only the first one starts the row count (a later
// one used to forget the rows decoded so far, and any binary PPM/PGM above 4 KB read as truncated).
void on_size_prepared(GdkPixbufLoader* loader, gint width, gint height, gpointer data) {
  auto* progress = static_cast<LoadProgress*>(data);
  if (progress->size_known) return;
  progress->size_known = true;
  progress->width = width;
  progress->height = height;
  if (width > kMaxDecodedImageSide || height > kMaxDecodedImageSide ||
      static_cast<int64_t>(width) * height > kMaxDecodedImagePixels) {
    progress->too_big = true;
    // A size of 0 makes the loaders stop before allocating the canvas (as gdk_pixbuf_get_file_info does).
    gdk_pixbuf_loader_set_size(loader, 0, 0);
  } else {
    progress->rows_done.assign(static_cast<size_t>(std::max(height, 0)), false);
  }
}

void on_area_updated(GdkPixbufLoader*, gint, gint y, gint, gint height, gpointer data) {
  auto* progress = static_cast<LoadProgress*>(data);
  const int64_t end =
      std::min<int64_t>(static_cast<int64_t>(y) + height, static_cast<int64_t>(progress->rows_done.size()));
  for (int64_t r = std::max(y, 0); r < end; ++r) progress->rows_done[static_cast<size_t>(r)] = true;
}

// Whether a PNG's chunks run whole from the signature to an IEND chunk (bytes after it are
// ignored, as PIL does). gdk-pixbuf accepts a file that stops after its last image row.
bool png_has_iend(const uint8_t* data, size_t size) {
  constexpr size_t kSignature = 8, kChunkOverhead = 12;  // length, type, CRC
  for (size_t at = kSignature; at + kChunkOverhead <= size;) {
    const uint32_t length =
        (uint32_t{data[at]} << 24) | (uint32_t{data[at + 1]} << 16) | (uint32_t{data[at + 2]} << 8) | data[at + 3];
    if (std::memcmp(data + at + 4, "IEND", 4) == 0) return true;
    if (length > size - at - kChunkOverhead) return false;
    at += kChunkOverhead + length;
  }
  return false;
}

// Whether the image is 16-bit grayscale without alpha: a PNG of colour type 0 and bit depth 16, or
// a TIFF whose first image has one sample per pixel of 16 bits. PIL opens these as 32-bit
// integers (mode I / I;16) and its convert("RGB"), which transformers applies, clips each sample
// to 0..255, so that only samples below 256 keep their value; gdk-pixbuf hands back only each
// sample's high byte (v >> 8), from which those values cannot be recovered. (Every other 16-bit
// PNG or TIFF layout becomes 8 bits per sample in PIL by its high byte, as in gdk-pixbuf.)
bool is_16bit_grayscale(const uint8_t* data, size_t size) {
  static const uint8_t kPngSignature[8] = {0x89, 'P', 'N', 'G', '\r', '\n', 0x1A, '\n'};
  if (size >= 26 && std::memcmp(data, kPngSignature, 8) == 0 && std::memcmp(data + 12, "IHDR", 4) == 0)
    return data[24] == 16 && data[25] == 0;  // bit depth, colour type (greyscale)
  const bool le = size >= 8 && std::memcmp(data, "II*\0", 4) == 0;
  if (!le && !(size >= 8 && std::memcmp(data, "MM\0*", 4) == 0)) return false;
  auto u16 = [&](size_t at) { return le ? data[at] | (data[at + 1] << 8) : (data[at] << 8) | data[at + 1]; };
  auto u32 = [&](size_t at) { return (uint32_t(u16(le ? at + 2 : at)) << 16) | uint32_t(u16(le ? at : at + 2)); };
  const size_t ifd = u32(4);
  if (ifd > size - 2) return false;
  int bits = 1, samples = 1;  // the TIFF defaults
  const size_t entries = u16(ifd);
  for (size_t i = 0, at = ifd + 2; i < entries && at + 12 <= size; ++i, at += 12) {
    const int tag = u16(at);
    // BitsPerSample (258) of one sample and SamplesPerPixel (277) are SHORTs held in the entry.
    if (tag == 258 && u32(at + 4) == 1) bits = u16(at + 8);
    if (tag == 277) samples = u16(at + 8);
  }
  return bits == 16 && samples == 1;
}

// Whether a WebP file holds every byte its RIFF header counts. The WebP loader decodes what it has
// of a truncated file, reporting every row, where PIL (libwebp's demuxer) refuses it.
bool webp_is_whole(const uint8_t* data, size_t size) {
  if (size < 12) return false;
  const uint32_t riff_size =
      uint32_t{data[4]} | (uint32_t{data[5]} << 8) | (uint32_t{data[6]} << 16) | (uint32_t{data[7]} << 24);
  return size - 8 >= riff_size;
}

// The maxval of a PNM with samples (P2, P3, P5, P6), or 0 (another format, a bitmap, or a header
// the loader refuses itself). Header tokens are separated by whitespace and '#' comments.
long pnm_maxval(const uint8_t* data, size_t size) {
  if (size < 2 || data[0] != 'P' || (data[1] != '2' && data[1] != '3' && data[1] != '5' && data[1] != '6')) return 0;
  size_t at = 2;
  long value = 0;
  for (int token = 0; token < 3; ++token) {  // width, height, maxval
    while (at < size && (g_ascii_isspace(data[at]) || data[at] == '#')) {
      if (data[at] == '#')
        while (at < size && data[at] != '\n' && data[at] != '\r') ++at;
      else
        ++at;
    }
    const size_t start = at;
    value = 0;
    while (at < size && g_ascii_isdigit(data[at]) && value <= 65535) value = value * 10 + (data[at++] - '0');
    if (at == start) return 0;
  }
  return value;
}

// PIL scales the samples of a PNM whose maxval m is below 255 to round-half-even(v / m * 255)
// (Python's round); gdk-pixbuf to floor(255 * v / m), which for m < 255 keeps every v apart
// (and gives 255 for v > m, as PIL does for binary files): map the one onto the other.
void rescale_pnm_samples_as_pil(long maxval, std::vector<uint8_t>& pixels) {
  uint8_t pil[256];
  for (int g = 0; g < 256; ++g) pil[g] = static_cast<uint8_t>(g);
  for (long v = 0; v <= maxval; ++v)
    pil[255 * v / maxval] = static_cast<uint8_t>(std::nearbyint(static_cast<double>(v) / maxval * 255.0));
  for (uint8_t& p : pixels) p = pil[p];
}

// Why a GIF cannot be decoded safely, or "" (also when it ends early: the loader then reports
// that itself). gdk-pixbuf's GIF loader clips each frame to the canvas, but for a frame that lies
// wholly outside it asks for a pixbuf of width 0, and for a frame that reaches beyond it with
// disposal "restore to previous" copies an area outside the canvas (whether a frame has that
// disposal depends on stale bytes when its control block is empty): GLib criticals (fatal where
// criticals are) instead of errors. Such frames are refused, as any frame beyond the canvas is.
std::string gif_frame_problem(const uint8_t* data, size_t size) {
  auto u16 = [&](size_t at) { return static_cast<int>(data[at] | (data[at + 1] << 8)); };
  constexpr size_t kHeader = 6, kScreen = 7, kDescriptor = 9;
  if (size < kHeader + kScreen) return "";
  const int canvas_w = u16(6), canvas_h = u16(8);
  auto color_table = [](uint8_t packed) { return packed & 0x80 ? size_t{3} << ((packed & 7) + 1) : size_t{0}; };
  size_t at = kHeader + kScreen + color_table(data[10]);
  // Data sub-blocks: a length byte, that many bytes, ... up to a zero length.
  auto skip_sub_blocks = [&]() {
    while (at < size && data[at] != 0) at += size_t{data[at]} + 1;
    ++at;
  };
  for (int frame = 0; at < size;) {
    const uint8_t kind = data[at++];
    if (kind == 0x3B) break;  // trailer
    if (kind == 0x21) {       // extension: its label, then sub-blocks
      ++at;
      skip_sub_blocks();
    } else if (kind == 0x2C) {
      if (at + kDescriptor > size) break;
      const int left = u16(at), top = u16(at + 2), w = u16(at + 4), h = u16(at + 6);
      ++frame;
      if (w == 0 || h == 0 || left >= canvas_w || top >= canvas_h)
        return "GIF frame " + std::to_string(frame) + " (" + std::to_string(w) + "x" + std::to_string(h) + " at " +
               std::to_string(left) + "," + std::to_string(top) + ") shows nothing of the " + std::to_string(canvas_w) +
               "x" + std::to_string(canvas_h) + " canvas";
      if (left + w > canvas_w || top + h > canvas_h)
        return "GIF frame " + std::to_string(frame) + " (" + std::to_string(w) + "x" + std::to_string(h) + " at " +
               std::to_string(left) + "," + std::to_string(top) + ") reaches beyond the " + std::to_string(canvas_w) +
               "x" + std::to_string(canvas_h) + " canvas";
      at += kDescriptor + color_table(data[at + 8]) + 1;  // + the LZW code size byte
      skip_sub_blocks();
    }
    // Any other byte is skipped, as the loader skips it, looking for the next block.
  }
  return "";
}

// Why a decoded image is incomplete, or "" when it is whole. For several formats gdk-pixbuf hands
// back whatever it decoded of a truncated file without an error, the rest left blank; PIL refuses
// such files ("image file is truncated"), and a partly blank image must not be encoded as if it
// were whole.
std::string truncation(const std::string& format, const uint8_t* data, size_t size, const LoadProgress& progress) {
  // GIF: frames may cover only part of the canvas, and the loader reports truncation itself.
  if (format == "gif") return "";
  // JPEG: libjpeg fills missing scanlines, so every row is reported; a complete file has an
  // end-of-image marker after its last start-of-scan.
  if (format == "jpeg") {
    size_t last_sos = 0;
    bool eoi_after = false;
    for (size_t i = 0; i + 1 < size; ++i) {
      if (data[i] != 0xFF) continue;
      if (data[i + 1] == 0xDA) {
        last_sos = i;
        eoi_after = false;
      } else if (data[i + 1] == 0xD9 && last_sos > 0) {
        eoi_after = true;
      }
    }
    return eoi_after ? "" : "no end-of-image marker after the last scan";
  }
  if (std::find(progress.rows_done.begin(), progress.rows_done.end(), false) != progress.rows_done.end())
    return "image rows missing";
  if (format == "png" && !png_has_iend(data, size)) return "no IEND chunk";
  if (format == "webp" && !webp_is_whole(data, size)) return "fewer bytes than its RIFF header counts";
  return "";
}

std::string describe(const GError* error) { return error != nullptr ? error->message : "unknown error"; }

// gdk-pixbuf's loaders meet some malformed input with a GLib critical or warning (a failed
// g_return_if_fail inside the library) instead of an error, and carry on with what they have.
// The checks above refuse the cases known, with a precise reason; this refuses the rest: while
// this thread decodes, the "GdkPixbuf" domain's criticals and warnings become the decode's error
// (the fuzz target found GIFs whose frame layout the loader reads differently from the format).
// Elsewhere they go to GLib's default handler, as before.
thread_local std::string* t_decoder_problems = nullptr;

void on_gdk_pixbuf_log(const gchar* domain, GLogLevelFlags level, const gchar* message, gpointer) {
  if (t_decoder_problems != nullptr && (level & (G_LOG_LEVEL_CRITICAL | G_LOG_LEVEL_WARNING)) != 0) {
    if (t_decoder_problems->empty()) *t_decoder_problems = message != nullptr ? message : "";
    return;
  }
  g_log_default_handler(domain, level, message, nullptr);
}

// Collects the decoder's criticals and warnings for as long as it lives (one decode).
class DecoderLogCapture {
 public:
  DecoderLogCapture() {
    static std::once_flag installed;
    std::call_once(installed, [] {
      g_log_set_handler("GdkPixbuf", static_cast<GLogLevelFlags>(G_LOG_LEVEL_MASK | G_LOG_FLAG_FATAL),
                        on_gdk_pixbuf_log, nullptr);
    });
    t_decoder_problems = &problems_;
  }
  ~DecoderLogCapture() { t_decoder_problems = nullptr; }
  DecoderLogCapture(const DecoderLogCapture&) = delete;
  DecoderLogCapture& operator=(const DecoderLogCapture&) = delete;
  const std::string& first_problem() const { return problems_; }

 private:
  std::string problems_;
};

}  // namespace

RgbImage decode_image(const uint8_t* data, size_t size, const std::string& what) {
  if (data == nullptr || size == 0) throw Error(what + ": empty image data");

  if (is_16bit_grayscale(data, size))
    throw Error(what +
                ": 16-bit grayscale images are not supported: PIL (and so transformers) clips their samples "
                "to 0..255, which needs each sample's low byte, and the image decoder (gdk-pixbuf) keeps only "
                "the high byte; convert the image to 8 bits per sample");
  const long maxval = pnm_maxval(data, size);
  if (maxval > 255 && maxval <= 65535)
    throw Error(what + ": PNM images of more than 8 bits per sample (maxval " + std::to_string(maxval) +
                ") are not supported: PIL's (and so transformers') 8-bit result needs each full sample (it "
                "rounds colour samples and clips grey ones), and the image decoder (gdk-pixbuf) keeps only 8 "
                "bits of it; convert the image to 8 bits per sample");
  if (size >= 4 && std::memcmp(data, "GIF8", 4) == 0) {
    const std::string problem = gif_frame_problem(data, size);
    if (!problem.empty()) throw Error(what + ": " + problem);
  }

  DecoderLogCapture decoder_log;
  GdkPixbufLoader* loader = gdk_pixbuf_loader_new();
  LoadProgress progress;
  g_signal_connect(loader, "size-prepared", G_CALLBACK(on_size_prepared), &progress);
  g_signal_connect(loader, "area-updated", G_CALLBACK(on_area_updated), &progress);

  // Fed in chunks so that an oversized image is refused once its header has been read.
  constexpr size_t kChunk = 64 * 1024;
  GError* error = nullptr;
  bool ok = true;
  for (size_t at = 0; at < size && ok && !progress.too_big; at += kChunk)
    ok = gdk_pixbuf_loader_write(loader, data + at, std::min(kChunk, size - at), &error);
  // close() must always be called; its error (e.g. truncated data) matters only when writing went well.
  if (!gdk_pixbuf_loader_close(loader, ok && !progress.too_big ? &error : nullptr)) ok = false;

  auto fail = [&](const std::string& reason) {
    g_clear_error(&error);
    g_object_unref(loader);
    throw Error(what + ": " + reason);
  };
  if (progress.too_big)
    fail("image of " + std::to_string(progress.width) + "x" + std::to_string(progress.height) +
         " pixels exceeds the limit of " + std::to_string(kMaxDecodedImageSide) + " pixels per side and " +
         std::to_string(kMaxDecodedImagePixels) + " pixels in all");
  if (!decoder_log.first_problem().empty())
    fail("malformed image data (the image decoder reported: " + decoder_log.first_problem() + ")");
  if (!ok) {
    if (error != nullptr && error->domain == GDK_PIXBUF_ERROR && error->code == GDK_PIXBUF_ERROR_UNKNOWN_TYPE)
      fail("unknown image format (not a file type the installed gdk-pixbuf loaders read)");
    fail("corrupt or truncated image data (" + describe(error) + ")");
  }
  GdkPixbufFormat* format = gdk_pixbuf_loader_get_format(loader);
  gchar* name = format != nullptr ? gdk_pixbuf_format_get_name(format) : nullptr;
  const std::string format_name = name != nullptr ? name : "";
  g_free(name);
  const std::string missing = truncation(format_name, data, size, progress);
  if (!missing.empty())
    fail("truncated " + format_name + " image data (" + missing + ": the file ends before the image does)");
  GdkPixbuf* pixbuf = gdk_pixbuf_loader_get_pixbuf(loader);
  if (pixbuf == nullptr) fail("corrupt or truncated image data (no image decoded)");
  const int channels = gdk_pixbuf_get_n_channels(pixbuf);
  if (gdk_pixbuf_get_colorspace(pixbuf) != GDK_COLORSPACE_RGB || gdk_pixbuf_get_bits_per_sample(pixbuf) != 8 ||
      (channels != 3 && channels != 4))
    fail("unsupported pixel layout (" + std::to_string(channels) + " channels of " +
         std::to_string(gdk_pixbuf_get_bits_per_sample(pixbuf)) + " bits)");

  RgbImage image;
  image.width = gdk_pixbuf_get_width(pixbuf);
  image.height = gdk_pixbuf_get_height(pixbuf);
  const size_t rowstride = static_cast<size_t>(gdk_pixbuf_get_rowstride(pixbuf));
  const guint8* src = gdk_pixbuf_read_pixels(pixbuf);
  const size_t row_bytes = static_cast<size_t>(image.width) * 3;
  image.pixels.resize(row_bytes * static_cast<size_t>(image.height));
  for (int y = 0; y < image.height; ++y) {
    const guint8* in = src + static_cast<size_t>(y) * rowstride;
    uint8_t* out = image.pixels.data() + static_cast<size_t>(y) * row_bytes;
    if (channels == 3) {
      std::memcpy(out, in, row_bytes);
    } else {  // RGBA: drop alpha, as PIL's convert("RGB") does
      for (int x = 0; x < image.width; ++x, in += 4, out += 3) {
        out[0] = in[0];
        out[1] = in[1];
        out[2] = in[2];
      }
    }
  }
  g_object_unref(loader);  // owns the pixbuf
  if (format_name == "pnm" && maxval > 0 && maxval < 255) rescale_pnm_samples_as_pil(maxval, image.pixels);
  return image;
}

std::vector<uint8_t> read_image_file(const std::string& path) {
  const std::string what = "image file '" + path + "'";
  FILE* f = std::fopen(path.c_str(), "rb");
  if (f == nullptr) throw Error(what + " cannot be read: " + g_strerror(errno));
  std::vector<uint8_t> bytes;
  uint8_t chunk[64 * 1024];
  size_t n = 0;
  while ((n = std::fread(chunk, 1, sizeof chunk, f)) > 0) bytes.insert(bytes.end(), chunk, chunk + n);
  const int read_errno = std::ferror(f) ? errno : 0;
  std::fclose(f);
  if (read_errno != 0) throw Error(what + " cannot be read: " + g_strerror(read_errno));
  return bytes;
}

RgbImage decode_image_file(const std::string& path) {
  const std::vector<uint8_t> bytes = read_image_file(path);
  return decode_image(bytes.data(), bytes.size(), "image file '" + path + "'");
}

}  // namespace moe
