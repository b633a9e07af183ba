/* Input files: plain, gzip (zlib) or zstd, told apart by their first bytes, not their names. */
#include <errno.h>
#include <fcntl.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <zlib.h>
#include <zstd.h>

#include "datasets/ds_internal.h"

enum { IN_PLAIN, IN_GZIP, IN_ZSTD };
#define RAW_BYTES (1u << 18)

/* gzip is decoded with inflate rather than gzread: gzread ends the input quietly at whatever
 * follows a member when it does not begin with the gzip magic (a damaged second member,
 * trailing bytes), which lost those rows without an error. Both decoders here take every byte
 * of the file as part of a member / frame, so such input fails naming where. */
struct ds_input {
    char *path;
    int kind;
    int fd;
    z_stream zs;
    int zs_live;
    ZSTD_DCtx *zd;
    uint8_t *raw; /* compressed bytes read from fd: raw[raw_pos, raw_len) are not decoded yet */
    size_t raw_len, raw_pos;
    uint64_t raw_off;  /* file offset of raw[0] */
    uint64_t unit_off; /* file offset where the current gzip member / zstd frame starts */
    int unit_end;      /* the last decoder step ended a member / frame */
    int raw_eof;
    uint8_t head[4]; /* plain input from a pipe: the first bytes, read to tell the codec */
    size_t head_len, head_pos;
};

static int read_fd(int fd, void *buf, size_t n, size_t *got)
{
    for (;;) {
        ssize_t r = read(fd, buf, n);
        if (r < 0 && errno == EINTR) continue;
        if (r < 0) return CM_EIO;
        *got = (size_t)r;
        return CM_OK;
    }
}

int ds_input_open(const char *path, ds_input **out, char **errptr)
{
    ds_input *in = calloc(1, sizeof *in);
    int rc = CM_OK;
    if (in == NULL || (in->path = strdup(path)) == NULL) {
        free(in);
        return cm_err(errptr, CM_ENOMEM, "out of memory");
    }
    in->fd = open(path, O_RDONLY | O_CLOEXEC);
    if (in->fd < 0) {
        rc = cm_err_errno(errptr, errno == ENOENT ? CM_ENOTFOUND : CM_EIO, "cannot open %s",
                          path);
        goto out;
    }
    uint8_t magic[4] = {0};
    ssize_t m = pread(in->fd, magic, 4, 0);
    /* a pipe (`/dev/stdin < x.gz`, `<(zcat ...)`) cannot be read at an offset: its first bytes
     * are read here and handed on, or a gzip / zstd stream on one was taken for text */
    int consumed = m < 0 && errno == ESPIPE;
    if (consumed) {
        size_t got = 0, r = 1;
        while (got < 4 && r > 0) {
            if (read_fd(in->fd, magic + got, 4 - got, &r) != CM_OK) {
                rc = cm_err_errno(errptr, CM_EIO, "cannot read %s", path);
                goto out;
            }
            got += r;
        }
        m = (ssize_t)got;
    }
    if (m >= 2 && magic[0] == 0x1f && magic[1] == 0x8b) {
        in->kind = IN_GZIP;
        /* 15 + 16: gzip wrapper only, so a member followed by a zlib or raw stream is refused */
        int zr = inflateInit2(&in->zs, 15 + 16);
        if (zr != Z_OK) {
            rc = cm_err(errptr, CM_ENOMEM, "cannot start gzip reader for %s", path);
            goto out;
        }
        in->zs_live = 1;
    } else if (m == 4 &&
               ((magic[0] == 0x28 && magic[1] == 0xb5 && magic[2] == 0x2f && magic[3] == 0xfd) ||
                /* a skippable frame (0x184D2A5?): pzstd starts every file with one;
                 * the frame decoder skips it like any other zstd reader */
                ((magic[0] & 0xf0) == 0x50 && magic[1] == 0x2a && magic[2] == 0x4d &&
                 magic[3] == 0x18))) {
        in->kind = IN_ZSTD;
        if ((in->zd = ZSTD_createDCtx()) == NULL) {
            rc = cm_err(errptr, CM_ENOMEM, "out of memory");
            goto out;
        }
    }
    if (in->kind != IN_PLAIN && (in->raw = malloc(RAW_BYTES)) == NULL) {
        rc = cm_err(errptr, CM_ENOMEM, "out of memory");
        goto out;
    }
    if (consumed && m > 0) {
        if (in->kind != IN_PLAIN) {
            memcpy(in->raw, magic, (size_t)m);
            in->raw_len = (size_t)m;
        } else {
            memcpy(in->head, magic, (size_t)m);
            in->head_len = (size_t)m;
        }
    }
out:
    if (rc != CM_OK) {
        ds_input_close(in);
        return rc;
    }
    *out = in;
    return CM_OK;
}

/* One inflate call from raw into buf[*pos, n). NULL, or what is wrong with the data. */
static const char *gzip_step(ds_input *in, uint8_t *buf, size_t n, size_t *pos)
{
    z_stream *s = &in->zs;
    /* a member ended and more bytes follow: they must be another member, header first */
    if (in->unit_end && inflateReset(s) != Z_OK) return "cannot restart inflate";
    s->next_in = in->raw + in->raw_pos;
    s->avail_in = (uInt)(in->raw_len - in->raw_pos);
    s->next_out = buf + *pos;
    s->avail_out = (uInt)(n - *pos);
    int r = inflate(s, Z_NO_FLUSH);
    in->raw_pos = in->raw_len - s->avail_in;
    *pos = n - s->avail_out;
    in->unit_end = r == Z_STREAM_END;
    if (r == Z_OK || r == Z_STREAM_END || r == Z_BUF_ERROR) return NULL;
    if (r == Z_NEED_DICT) return "needs a preset dictionary";
    return s->msg ? s->msg : zError(r);
}

/* One ZSTD_decompressStream call from raw into buf[*pos, n). NULL, or what is wrong. */
static const char *zstd_step(ds_input *in, uint8_t *buf, size_t n, size_t *pos)
{
    ZSTD_inBuffer ib = {in->raw, in->raw_len, in->raw_pos};
    ZSTD_outBuffer ob = {buf, n, *pos};
    size_t r = ZSTD_decompressStream(in->zd, &ob, &ib);
    in->raw_pos = ib.pos;
    *pos = ob.pos;
    if (ZSTD_isError(r)) return ZSTD_getErrorName(r);
    /* 0: a frame is decoded and flushed, and the call stopped at its last byte */
    in->unit_end = r == 0;
    return NULL;
}

/* Decodes into buf until something is there or the file ends; the file must end where a member
 * or frame does. Offsets in errors count bytes of the compressed file. */
static int decode_read(ds_input *in, uint8_t *buf, size_t n, size_t *got, char **errptr)
{
    const char *codec = in->kind == IN_GZIP ? "gzip" : "zstd";
    const char *unit = in->kind == IN_GZIP ? "member" : "frame";
    size_t pos = 0;
    while (pos == 0) {
        if (in->raw_pos == in->raw_len) {
            if (in->raw_eof) break;
            size_t r;
            if (read_fd(in->fd, in->raw, RAW_BYTES, &r) != CM_OK)
                return cm_err_errno(errptr, CM_EIO, "cannot read %s", in->path);
            in->raw_off += in->raw_len;
            in->raw_len = r;
            in->raw_pos = 0;
            if (r == 0) {
                in->raw_eof = 1;
                break;
            }
        }
        if (in->unit_end) in->unit_off = in->raw_off + in->raw_pos;
        const char *bad =
            in->kind == IN_GZIP ? gzip_step(in, buf, n, &pos) : zstd_step(in, buf, n, &pos);
        if (bad != NULL)
            return cm_err(errptr, CM_ECORRUPT,
                          "%s: corrupt %s data in the %s starting at byte %llu (found by byte "
                          "%llu): %s",
                          in->path, codec, unit, (unsigned long long)in->unit_off,
                          (unsigned long long)(in->raw_off + in->raw_pos), bad);
    }
    /* the first member / frame counts as unfinished until it ends, so a file holding only a
     * magic is cut too */
    if (pos == 0 && !in->unit_end)
        return cm_err(errptr, CM_ECORRUPT,
                      "%s: truncated %s data: the file ends at byte %llu inside the %s starting "
                      "at byte %llu",
                      in->path, codec, (unsigned long long)(in->raw_off + in->raw_len), unit,
                      (unsigned long long)in->unit_off);
    *got = pos;
    return CM_OK;
}

int ds_input_read(ds_input *in, void *buf, size_t n, size_t *got, char **errptr)
{
    *got = 0;
    if (n == 0) return CM_OK;
    /* inflate counts in uInt */
    if (n > (1u << 30)) n = 1u << 30;
    if (in->kind != IN_PLAIN) return decode_read(in, buf, n, got, errptr);
    if (in->head_pos < in->head_len) {
        size_t k = in->head_len - in->head_pos < n ? in->head_len - in->head_pos : n;
        memcpy(buf, in->head + in->head_pos, k);
        in->head_pos += k;
        *got = k;
        return CM_OK;
    }
    if (read_fd(in->fd, buf, n, got) != CM_OK)
        return cm_err_errno(errptr, CM_EIO, "cannot read %s", in->path);
    return CM_OK;
}

int ds_input_plain_fd(const ds_input *in)
{
    return in->kind == IN_PLAIN ? in->fd : -1;
}

void ds_input_close(ds_input *in)
{
    if (in == NULL) return;
    if (in->zs_live) inflateEnd(&in->zs);
    if (in->fd >= 0) close(in->fd);
    ZSTD_freeDCtx(in->zd);
    free(in->raw);
    free(in->path);
    free(in);
}
