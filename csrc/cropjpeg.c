/* Decode one rectangle of a JPEG frame with libjpeg-turbo, skipping the work outside it.
 *
 * Rows above the rectangle are skipped (jpeg_skip_scanlines: entropy-decoded only, no inverse
 * DCT, upsampling or colour conversion), rows below it are never decoded, and only the
 * iMCU columns around it are transformed (jpeg_crop_scanline). The frame can be scaled by
 * 1/2, 1/4 or 1/8 in the DCT domain first, as PIL's draft() does.
 *
 * The pixels equal those of a full decode followed by a crop: libjpeg-turbo treats the edges
 * of a cropped band like image edges when it upsamples chroma, so the band decoded is wider
 * and taller than the rectangle by a margin, which is thrown away.
 *
 * A plain C library (no Python headers), loaded with ctypes by trainer/cropdecode.py and
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

/* Decode the rectangle (x, y, w, h) of the frame scaled by 1/denom as RGB into out, whose
 * rows are out_stride bytes apart. Returns 0, or -1 with a message in msg. */
int kf_decode_crop(const unsigned char *data, unsigned long size, int denom, int x, int y, int w, int h,
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
