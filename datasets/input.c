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
#define ZIN_BYTES (1u << 17)

struct ds_input {
    char *path;
    int kind;
    int fd;
    gzFile gz;
    ZSTD_DCtx *zd;
    uint8_t *zin;
    ZSTD_inBuffer zbuf;
    size_t zlast; /* last ZSTD_decompressStream result: 0 when a frame just ended */
    int zeof;
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
    if (m >= 2 && magic[0] == 0x1f && magic[1] == 0x8b) {
        in->kind = IN_GZIP;
        in->gz = gzdopen(in->fd, "rb");
        if (in->gz == NULL) {
            rc = cm_err(errptr, CM_ENOMEM, "cannot start gzip reader for %s", path);
            goto out;
        }
        in->fd = -1; /* gzclose owns it now */
        gzbuffer(in->gz, 1u << 18);
    } else if (m == 4 && magic[0] == 0x28 && magic[1] == 0xb5 && magic[2] == 0x2f &&
               magic[3] == 0xfd) {
        in->kind = IN_ZSTD;
        in->zd = ZSTD_createDCtx();
        in->zin = malloc(ZIN_BYTES);
        if (in->zd == NULL || in->zin == NULL) {
            rc = cm_err(errptr, CM_ENOMEM, "out of memory");
            goto out;
        }
        in->zbuf = (ZSTD_inBuffer){in->zin, 0, 0};
    }
out:
    if (rc != CM_OK) {
        ds_input_close(in);
        return rc;
    }
    *out = in;
    return CM_OK;
}

static int zstd_read(ds_input *in, void *buf, size_t n, size_t *got, char **errptr)
{
    ZSTD_outBuffer ob = {buf, n, 0};
    while (ob.pos == 0) {
        if (in->zbuf.pos == in->zbuf.size) {
            if (in->zeof) break;
            size_t r;
            if (read_fd(in->fd, in->zin, ZIN_BYTES, &r) != CM_OK)
                return cm_err_errno(errptr, CM_EIO, "cannot read %s", in->path);
            if (r == 0) {
                in->zeof = 1;
                break;
            }
            in->zbuf = (ZSTD_inBuffer){in->zin, r, 0};
        }
        size_t ret = ZSTD_decompressStream(in->zd, &ob, &in->zbuf);
        if (ZSTD_isError(ret))
            return cm_err(errptr, CM_ECORRUPT, "%s: corrupt zstd data: %s", in->path,
                          ZSTD_getErrorName(ret));
        in->zlast = ret;
    }
    if (ob.pos == 0 && in->zeof && in->zlast != 0)
        return cm_err(errptr, CM_ECORRUPT, "%s: truncated zstd data", in->path);
    *got = ob.pos;
    return CM_OK;
}

int ds_input_read(ds_input *in, void *buf, size_t n, size_t *got, char **errptr)
{
    *got = 0;
    if (n > (1u << 30)) n = 1u << 30;
    switch (in->kind) {
    case IN_GZIP: {
        int r = gzread(in->gz, buf, (unsigned)n);
        if (r < 0) {
            int e;
            const char *msg = gzerror(in->gz, &e);
            return cm_err(errptr, CM_ECORRUPT, "%s: corrupt gzip data: %s", in->path, msg);
        }
        if (r == 0) {
            int e;
            const char *msg = gzerror(in->gz, &e);
            if (e != Z_OK && e != Z_STREAM_END)
                return cm_err(errptr, CM_ECORRUPT, "%s: gzip: %s", in->path, msg);
        }
        *got = (size_t)r;
        return CM_OK;
    }
    case IN_ZSTD:
        return zstd_read(in, buf, n, got, errptr);
    default:
        if (read_fd(in->fd, buf, n, got) != CM_OK)
            return cm_err_errno(errptr, CM_EIO, "cannot read %s", in->path);
        return CM_OK;
    }
}

int ds_input_plain_fd(const ds_input *in)
{
    return in->kind == IN_PLAIN ? in->fd : -1;
}

void ds_input_close(ds_input *in)
{
    if (in == NULL) return;
    if (in->gz) gzclose(in->gz);
    if (in->fd >= 0) close(in->fd);
    ZSTD_freeDCtx(in->zd);
    free(in->zin);
    free(in->path);
    free(in);
}
