/* Decode one rectangle of a JPEG frame with libjpeg-turbo, skipping the work outside it.
 *
 * Rows above the rectangle are skipped (jpeg_skip_scanlines: entropy-decoded only, no inverse
 * DCT, upsampling or colour conversion), rows below it are never decoded, and only the
 * iMCU columns around it are transformed (jpeg_crop_scanline). The frame can be scaled by
 * 1/2, 1/4 or 1/8 in the DCT domain first, as PIL's draft() does.
 *
 * A baseline JPEG with restart markers whose intervals tile its MCU rows (ingest writes these,
 * ingest/jpeg.py) is first cut down without decoding anything: the restart intervals that
 * cover the rectangle and its context are copied, in order and with their markers renumbered,
 * into a smaller JPEG whose SOF gives the smaller size, and only that is decoded. Each interval
 * starts with the DC predictions reset, so it decodes alone as it did in the whole frame; the
 * entropy data above and beside the rectangle is never read, only scanned for markers.
 *
 * The pixels equal those of a full decode followed by a crop: libjpeg-turbo treats the edges
 * of a cropped band (and of the smaller JPEG) like image edges when it upsamples chroma, so the
 * band decoded is wider and taller than the rectangle by a margin, which is thrown away.
 *
 * A plain C library (no Python headers), loaded with ctypes by trainer/data/cropdecode.py and
 * built by scripts/build-native.sh against Debian's libjpeg62-turbo.
 */
#include <setjmp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <jpeglib.h>

/* Context kept around the rectangle: covers the fancy upsampler's neighbours (one chroma
 * sample, i.e. up to 2 pixels at 4:2:0) with room to spare. */
#ifndef MARGIN
#define MARGIN 8
#endif
#define CHUNK 16

struct error_mgr {
  struct jpeg_error_mgr pub;
  jmp_buf jump;
  char *msg;
  int msg_len;
};

static void on_error(j_common_ptr cinfo) {
  struct error_mgr *e = (struct error_mgr *)cinfo->err;
  char buf[JMSG_LENGTH_MAX];
  (*cinfo->err->format_message)(cinfo, buf);
  if (e->msg && e->msg_len > 0) snprintf(e->msg, e->msg_len, "%s", buf);
  longjmp(e->jump, 1);
}

/* Warnings (e.g. a truncated file) do not stop decoding, as with PIL. */
static void on_message(j_common_ptr cinfo, int level) { (void)cinfo; (void)level; }

static struct jpeg_error_mgr *errors_to(struct error_mgr *err, char *msg, int msg_len) {
  jpeg_std_error(&err->pub);
  err->pub.error_exit = on_error;
  err->pub.emit_message = on_message;
  err->msg = msg;
  err->msg_len = msg_len;
  return &err->pub;
}

/* Header read, RGB output at 1/denom scale requested (errors jump to the caller's setjmp). */
static void read_header(j_decompress_ptr cinfo, const unsigned char *data, unsigned long size, int denom) {
  jpeg_create_decompress(cinfo);
  jpeg_mem_src(cinfo, data, size);
  jpeg_read_header(cinfo, TRUE);
  cinfo->out_color_space = JCS_RGB;
  cinfo->scale_num = 1;
  cinfo->scale_denom = denom;
}

/* Frame size after scaling by 1/denom: the same rounding as libjpeg's output_width. */
int kf_scaled_size(const unsigned char *data, unsigned long size, int denom, int *width, int *height,
                   char *msg, int msg_len) {
  struct jpeg_decompress_struct cinfo;
  struct error_mgr err;
  cinfo.err = errors_to(&err, msg, msg_len);
  if (setjmp(err.jump)) {
    jpeg_destroy_decompress(&cinfo);
    return -1;
  }
  read_header(&cinfo, data, size, denom);
  jpeg_calc_output_dimensions(&cinfo);
  *width = cinfo.output_width;
  *height = cinfo.output_height;
  jpeg_destroy_decompress(&cinfo);
  return 0;
}

/* The rectangle (x, y, w, h) of the frame at 1/denom, through libjpeg-turbo's skipping and
 * cropping of scanlines. Returns 0, or -1 with a message in msg. */
static int decode_band(const unsigned char *data, unsigned long size, int denom, int x, int y, int w, int h,
                       unsigned char *out, long out_stride, char *msg, int msg_len) {
  struct jpeg_decompress_struct cinfo;
  struct error_mgr err;
  unsigned char *volatile row = NULL;
  cinfo.err = errors_to(&err, msg, msg_len);
  if (setjmp(err.jump)) {
    jpeg_destroy_decompress(&cinfo);
    free(row);
    return -1;
  }
  read_header(&cinfo, data, size, denom);
  jpeg_start_decompress(&cinfo);
  int fw = cinfo.output_width, fh = cinfo.output_height;
  if (x < 0 || y < 0 || w <= 0 || h <= 0 || x + w > fw || y + h > fh) {
    snprintf(msg, msg_len, "rectangle %dx%d+%d+%d outside the %dx%d frame", w, h, x, y, fw, fh);
    jpeg_destroy_decompress(&cinfo);
    return -1;
  }
  /* a band with MARGIN pixels of context on each side where the frame has them */
  int bx0 = x > MARGIN ? x - MARGIN : 0, bx1 = x + w + MARGIN < fw ? x + w + MARGIN : fw;
  JDIMENSION band_x = bx0, band_w = bx1 - bx0;
  if (band_w < (JDIMENSION)fw) jpeg_crop_scanline(&cinfo, &band_x, &band_w);
  /* rows are read CHUNK at a time (one row per call is about 1.5x slower); a row of the
   * rectangle whose band is exactly the rectangle goes straight to out, others via row */
  int direct = (int)band_x == x && (int)band_w == w;
  row = malloc((size_t)band_w * 3 * CHUNK);
  if (!row) {
    snprintf(msg, msg_len, "out of memory");
    jpeg_destroy_decompress(&cinfo);
    return -1;
  }
  int by0 = y > MARGIN ? y - MARGIN : 0;
  if (by0 > 0) by0 = jpeg_skip_scanlines(&cinfo, by0);
  JSAMPROW rows[CHUNK];
  for (int r = by0; r < y + h;) {
    int n = y + h - r < CHUNK ? y + h - r : CHUNK;
    for (int i = 0; i < n; i++)
      rows[i] = direct && r + i >= y ? out + (long)(r + i - y) * out_stride : row + (size_t)i * band_w * 3;
    n = jpeg_read_scanlines(&cinfo, rows, n);
    if (n == 0) {
      snprintf(msg, msg_len, "no more scanlines at row %d", r);
      jpeg_destroy_decompress(&cinfo);
      free(row);
      return -1;
    }
    for (int i = 0; i < n; i++)
      if (!direct && r + i >= y)
        memcpy(out + (long)(r + i - y) * out_stride, rows[i] + (x - (int)band_x) * 3, (size_t)w * 3);
    r += n;
  }
  /* the rows below the rectangle are never decoded: abort instead of finishing */
  jpeg_destroy_decompress(&cinfo);
  free(row);
  return 0;
}

/* What cutting a JPEG down to restart intervals needs from its headers. */
struct layout {
  unsigned long sof;     /* offset of the SOF's height field (width follows) */
  unsigned long scan;    /* first byte of entropy-coded data */
  int width, height;     /* of the frame, in pixels */
  int mcu_w, mcu_h;      /* MCU size in pixels */
  int mcus_x, mcus_y;    /* MCUs per row, MCU rows */
  int interval;          /* MCUs per restart interval */
  int context_x, context_y; /* pixels a pixel's chroma upsampling reads beside it: one chroma sample */
};

static int be16(const unsigned char *p) { return p[0] << 8 | p[1]; }

/* 1 when data is a single-scan baseline JPEG whose restart intervals tile its MCU rows (each
 * row a whole number of intervals), with its layout; 0 otherwise (decoded the ordinary way,
 * where libjpeg reports whatever is wrong with the headers). */
static int restart_layout(const unsigned char *d, unsigned long n, struct layout *L) {
  int components = 0, hmax = 1, vmax = 1;
  unsigned long p = 2;
  memset(L, 0, sizeof *L);
  if (n < 4 || d[0] != 0xFF || d[1] != 0xD8) return 0;
  while (p + 4 <= n) {
    if (d[p] != 0xFF) return 0;
    int m = d[p + 1];
    if (m == 0xFF) { p++; continue; } /* fill byte */
    unsigned long len = be16(d + p + 2);
    const unsigned char *s = d + p + 4;
    if (len < 2 || p + 2 + len > n) return 0;
    if (m == 0xC0 || m == 0xC1) { /* baseline or extended sequential, Huffman-coded */
      if (len < 8) return 0;
      components = s[5];
      if (components < 1 || len < 8 + 3 * (unsigned long)components) return 0;
      for (int c = 0; c < components; c++) {
        int hs = s[7 + 3 * c] >> 4, vs = s[7 + 3 * c] & 15;
        if (hs < 1 || hs > 4 || vs < 1 || vs > 4) return 0;
        hmax = hs > hmax ? hs : hmax;
        vmax = vs > vmax ? vs : vmax;
      }
      L->sof = p + 5;
      L->height = be16(s + 1);
      L->width = be16(s + 3);
    } else if (m >= 0xC2 && m <= 0xCF && m != 0xC4 && m != 0xC8 && m != 0xCC) {
      return 0; /* progressive, lossless or arithmetic-coded */
    } else if (m == 0xDD) {
      if (len != 4) return 0;
      L->interval = be16(s);
    } else if (m == 0xDA) {
      if (!L->sof || len < 3 || s[0] != components) return 0; /* one interleaved scan only */
      L->scan = p + 2 + len;
      break;
    }
    p += 2 + len;
  }
  if (!L->scan || L->interval <= 0 || L->width <= 0 || L->height <= 0) return 0;
  /* one component: an MCU is one block, whatever its sampling factors */
  L->mcu_w = components == 1 ? 8 : 8 * hmax;
  L->mcu_h = components == 1 ? 8 : 8 * vmax;
  L->context_x = hmax, L->context_y = vmax; /* at full size; less once scaled in the DCT */
  L->mcus_x = (L->width + L->mcu_w - 1) / L->mcu_w;
  L->mcus_y = (L->height + L->mcu_h - 1) / L->mcu_h;
  return L->mcus_x % L->interval == 0;
}

/* Byte ranges [start, end) of the entropy data of restart intervals 0..last, found by scanning
 * for markers (0xFF then 0x00 is a stuffed data byte, 0xFF then 0xFF a fill byte). Returns 0,
 * or -1 with a message when the data ends early or an interval's marker is missing. */
static int find_intervals(const unsigned char *d, unsigned long n, unsigned long scan, int last,
                          unsigned long *start, unsigned long *end, char *msg, int msg_len) {
  unsigned long q = scan;
  int k = 0;
  start[0] = scan;
  while (k <= last) {
    const unsigned char *ff = q < n ? memchr(d + q, 0xFF, n - q) : NULL;
    if (!ff) break;
    unsigned long i = ff - d, j = i + 1;
    while (j < n && d[j] == 0xFF) j++;
    if (j >= n) break;
    if (d[j] == 0x00) { q = j + 1; continue; }
    end[k] = i;
    if (d[j] < 0xD0 || d[j] > 0xD7) { /* EOI or another marker: the scan is over */
      if (k++ == last) return 0;
      snprintf(msg, msg_len, "entropy data ends after %d restart intervals, %d needed", k, last + 1);
      return -1;
    }
    if (d[j] != 0xD0 + k % 8) {
      snprintf(msg, msg_len, "restart marker RST%d at byte %lu where RST%d was expected (a marker is missing)",
               d[j] - 0xD0, i, k % 8);
      return -1;
    }
    q = start[++k] = j + 1;
  }
  if (k > last) return 0;
  snprintf(msg, msg_len, "entropy data truncated in restart interval %d of %d needed", k + 1, last + 1);
  return -1;
}

/* Cut the JPEG down to the restart intervals under the rectangle (x, y, w, h) of the frame at
 * 1/denom and the context around it: writes a smaller JPEG (at most size bytes) into cut and
 * the rectangle's position in it, scaled, to (*cx, *cy). Returns the smaller JPEG's size; 0 when
 * the JPEG cannot be cut or is best decoded whole (nothing written); -1 with a message in msg. */
long kf_cut(const unsigned char *data, unsigned long size, int denom, int x, int y, int w, int h,
            unsigned char *cut, int *cx, int *cy, char *msg, int msg_len) {
  struct layout L;
  if (!restart_layout(data, size, &L) || (denom != 1 && denom != 2 && denom != 4 && denom != 8)) return 0;
  int fw = (L.width + denom - 1) / denom, fh = (L.height + denom - 1) / denom;
  if (x < 0 || y < 0 || w <= 0 || h <= 0 || x + w > fw || y + h > fh) {
    snprintf(msg, msg_len, "rectangle %dx%d+%d+%d outside the %dx%d frame", w, h, x, y, fw, fh);
    return -1;
  }
  /* the MCUs under the rectangle and its context, widened to whole restart intervals */
  int sw = L.mcu_w / denom, sh = L.mcu_h / denom, per_row = L.mcus_x / L.interval;
  int px0 = x > L.context_x ? x - L.context_x : 0, px1 = x + w + L.context_x < fw ? x + w + L.context_x : fw;
  int py0 = y > L.context_y ? y - L.context_y : 0, py1 = y + h + L.context_y < fh ? y + h + L.context_y : fh;
  int c0 = px0 / sw / L.interval, c1 = ((px1 + sw - 1) / sw + L.interval - 1) / L.interval; /* intervals */
  int r0 = py0 / sh, r1 = (py1 + sh - 1) / sh;
  if (c1 > per_row) c1 = per_row;
  /* libjpeg upsamples chroma less smoothly in an image 2 chroma samples wide or less */
  while ((c1 - c0) * L.interval < 3 && (c0 > 0 || c1 < per_row)) {
    if (c0 > 0) c0--;
    else c1++;
  }
  if (r1 > L.mcus_y) r1 = L.mcus_y;
  if (c0 == 0 && c1 == per_row && r0 == 0 && r1 == L.mcus_y) return 0;
  int last = (r1 - 1) * per_row + c1 - 1;
  unsigned long *start = malloc(sizeof(unsigned long) * 2 * (last + 2)), *end = start + last + 2;
  if (!start) {
    snprintf(msg, msg_len, "out of memory");
    return -1;
  }
  if (find_intervals(data, size, L.scan, last, start, end, msg, msg_len)) {
    free(start);
    return -1;
  }
  /* the headers as they are but for the size in the SOF, then the intervals renumbered: each
   * copied interval had a marker after it, so the result is no longer than the input */
  unsigned long k = L.scan;
  memcpy(cut, data, k);
  int cut_w = (c1 * L.interval * L.mcu_w < L.width ? c1 * L.interval * L.mcu_w : L.width) - c0 * L.interval * L.mcu_w;
  int cut_h = (r1 * L.mcu_h < L.height ? r1 * L.mcu_h : L.height) - r0 * L.mcu_h;
  cut[L.sof] = cut_h >> 8, cut[L.sof + 1] = cut_h & 255, cut[L.sof + 2] = cut_w >> 8, cut[L.sof + 3] = cut_w & 255;
  int copied = 0;
  for (int r = r0; r < r1; r++)
    for (int c = c0; c < c1; c++) {
      int i = r * per_row + c;
      if (copied) cut[k++] = 0xFF, cut[k++] = 0xD0 + (copied - 1) % 8;
      memcpy(cut + k, data + start[i], end[i] - start[i]);
      k += end[i] - start[i];
      copied++;
    }
  cut[k++] = 0xFF, cut[k++] = 0xD9;
  free(start);
  *cx = x - c0 * L.interval * sw;
  *cy = y - r0 * sh;
  return (long)k;
}

/* Decode the rectangle (x, y, w, h) of the frame scaled by 1/denom as RGB into out, whose
 * rows are out_stride bytes apart: from the intervals under it where the JPEG can be cut
 * (kf_cut), else from the whole JPEG. Returns 0, or -1 with a message in msg. */
int kf_decode_crop(const unsigned char *data, unsigned long size, int denom, int x, int y, int w, int h,
                   unsigned char *out, long out_stride, char *msg, int msg_len) {
  unsigned char *cut = malloc(size + 1);
  int cx, cy;
  if (!cut) {
    snprintf(msg, msg_len, "out of memory");
    return -1;
  }
  long n = kf_cut(data, size, denom, x, y, w, h, cut, &cx, &cy, msg, msg_len);
  int rc = n < 0 ? -1
           : n ? decode_band(cut, n, denom, cx, cy, w, h, out, out_stride, msg, msg_len)
               : decode_band(data, size, denom, x, y, w, h, out, out_stride, msg, msg_len);
  free(cut);
  return rc;
}
