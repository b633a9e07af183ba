#define _GNU_SOURCE /* renameat2, O_DIRECT */
#include "common/common.h"

#include <dirent.h>
#include <errno.h>
#include <aio.h>
#include <fcntl.h>
#include <inttypes.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>
#include "common/xxh.h"

int cm_mkdirs(const char *dir, char **errptr)
{
    char *p = strdup(dir);
    int rc = CM_OK;
    if (p == NULL) return cm_err(errptr, CM_ENOMEM, "out of memory");
    for (char *s = p + 1;; s++) {
        if (*s != '/' && *s != '\0') continue;
        char c = *s;
        *s = '\0';
        if (mkdir(p, 0755) != 0 && errno != EEXIST) {
            rc = cm_err_errno(errptr, CM_EIO, "cannot create directory %s", p);
            break;
        }
        *s = c;
        if (c == '\0') break;
    }
    free(p);
    return rc;
}

int cm_fsync_dir(const char *dir, char **errptr)
{
    int fd = open(dir, O_RDONLY | O_DIRECTORY);
    if (fd < 0) return cm_err_errno(errptr, CM_EIO, "cannot open directory %s", dir);
    int rc = CM_OK;
    if (fsync(fd) != 0) rc = cm_err_errno(errptr, CM_EIO, "cannot fsync directory %s", dir);
    close(fd);
    return rc;
}

int cm_rmtree(const char *path, char **errptr)
{
    struct stat st;
    if (lstat(path, &st) != 0) {
        if (errno == ENOENT) return CM_OK;
        return cm_err_errno(errptr, CM_EIO, "cannot stat %s", path);
    }
    if (S_ISDIR(st.st_mode)) {
        DIR *d = opendir(path);
        if (d == NULL) return cm_err_errno(errptr, CM_EIO, "cannot open directory %s", path);
        struct dirent *e;
        int rc = CM_OK;
        while (rc == CM_OK && (e = readdir(d)) != NULL) {
            if (strcmp(e->d_name, ".") == 0 || strcmp(e->d_name, "..") == 0) continue;
            size_t n = strlen(path) + strlen(e->d_name) + 2;
            char *child = malloc(n);
            if (child == NULL) {
                rc = cm_err(errptr, CM_ENOMEM, "out of memory");
                break;
            }
            snprintf(child, n, "%s/%s", path, e->d_name);
            rc = cm_rmtree(child, errptr);
            free(child);
        }
        closedir(d);
        if (rc != CM_OK) return rc;
        if (rmdir(path) != 0) return cm_err_errno(errptr, CM_EIO, "cannot remove %s", path);
        return CM_OK;
    }
    if (unlink(path) != 0) return cm_err_errno(errptr, CM_EIO, "cannot remove %s", path);
    return CM_OK;
}

void cm_path_trim(char *path)
{
    for (size_t len = strlen(path); len > 1 && path[len - 1] == '/'; len--)
        path[len - 1] = '\0';
}

int cm_dir_swap(const char *tmpdir, const char *dir, char **errptr)
{
    /* Put in place if dir is absent, else exchanged: decided by the kernel in one call each,
     * not by a stat before them, so two swaps racing into an absent dir both succeed (the
     * second exchanges), where the second's plain rename failed on the first's new dir. A
     * filesystem without RENAME_NOREPLACE (EINVAL) takes the stat. */
    bool placed = renameat2(AT_FDCWD, tmpdir, AT_FDCWD, dir, RENAME_NOREPLACE) == 0;
    if (!placed && errno == EINVAL) {
        struct stat st;
        placed = stat(dir, &st) != 0 && rename(tmpdir, dir) == 0;
    }
    if (!placed && errno != EEXIST && errno != ENOTEMPTY && errno != EINVAL)
        return cm_err_errno(errptr, CM_EIO, "cannot rename %s to %s", tmpdir, dir);
    if (!placed) {
        if (renameat2(AT_FDCWD, tmpdir, AT_FDCWD, dir, RENAME_EXCHANGE) != 0)
            return cm_err_errno(errptr, CM_EIO, "cannot swap %s into %s", tmpdir, dir);
        int rc = cm_rmtree(tmpdir, errptr); /* now the previous tree */
        if (rc != CM_OK) return rc;
    }
    char *parent = strdup(dir);
    if (parent == NULL) return cm_err(errptr, CM_ENOMEM, "out of memory");
    char *slash = strrchr(parent, '/');
    if (slash == parent)
        slash[1] = '\0';
    else if (slash)
        *slash = '\0';
    int rc = cm_fsync_dir(slash ? parent : ".", errptr);
    free(parent);
    return rc;
}

int cm_dir_replaceable(const char *dir, const char *const *markers, char **errptr)
{
    struct stat st;
    if (lstat(dir, &st) != 0) return CM_OK;
    if (!S_ISDIR(st.st_mode))
        return cm_err(errptr, CM_EINVAL, "%s exists and is not a folder", dir);
    const char *missing = NULL;
    for (size_t i = 0; markers[i] != NULL && missing == NULL; i++) {
        char *path = malloc(strlen(dir) + strlen(markers[i]) + 2);
        if (path == NULL) return cm_err(errptr, CM_ENOMEM, "out of memory");
        sprintf(path, "%s/%s", dir, markers[i]);
        if (access(path, F_OK) != 0) missing = markers[i];
        free(path);
    }
    if (missing == NULL) return CM_OK;
    DIR *d = opendir(dir);
    if (d == NULL) return cm_err_errno(errptr, CM_EIO, "cannot open %s", dir);
    bool empty = true;
    struct dirent *e;
    while (empty && (e = readdir(d)) != NULL)
        empty = !strcmp(e->d_name, ".") || !strcmp(e->d_name, "..");
    closedir(d);
    return empty ? CM_OK
                 : cm_err(errptr, CM_EINVAL,
                          "%s is a folder that holds something other than an earlier output of "
                          "this kind (no %s): not replacing it",
                          dir, missing);
}

int cm_dir_other_entry(const char *dir, const char *const *names, char **other, char **errptr)
{
    *other = NULL;
    DIR *d = opendir(dir);
    if (d == NULL) return cm_err_errno(errptr, CM_EIO, "cannot read %s", dir);
    int rc = CM_OK;
    struct dirent *e;
    while (rc == CM_OK && *other == NULL && (e = readdir(d)) != NULL) {
        bool ours = !strcmp(e->d_name, ".") || !strcmp(e->d_name, "..");
        for (const char *const *n = names; !ours && *n != NULL; n++)
            ours = !strcmp(e->d_name, *n);
        if (!ours && (*other = strdup(e->d_name)) == NULL)
            rc = cm_err(errptr, CM_ENOMEM, "out of memory");
    }
    closedir(d);
    return rc;
}

int cm_write_full(int fd, const void *buf, size_t n)
{
    const char *p = buf;
    while (n > 0) {
        ssize_t w = write(fd, p, n);
        if (w < 0) {
            if (errno == EINTR) continue;
            return CM_EIO;
        }
        p += w;
        n -= (size_t)w;
    }
    return CM_OK;
}

int cm_pwrite_full(int fd, const void *buf, size_t n, uint64_t off)
{
    const uint8_t *p = buf;
    while (n > 0) {
        ssize_t k = pwrite(fd, p, n, (off_t)off);
        if (k < 0 && errno == EINTR) continue;
        if (k < 0) return errno;
        p += k;
        n -= (size_t)k;
        off += (uint64_t)k;
    }
    return 0;
}

int cm_pread_full(int fd, void *buf, size_t n, uint64_t off)
{
    uint8_t *p = buf;
    while (n > 0) {
        ssize_t k = pread(fd, p, n, (off_t)off);
        if (k < 0 && errno == EINTR) continue;
        if (k < 0) return errno;
        if (k == 0) return errno = EIO; /* the file is shorter than what was written to it */
        p += k;
        n -= (size_t)k;
        off += (uint64_t)k;
    }
    return 0;
}

int cm_scratch_open(const char *dir, int *fd, char **errptr)
{
    size_t len = strlen(dir) + 32;
    char *name = malloc(len);
    if (name == NULL) return cm_err(errptr, CM_ENOMEM, "out of memory");
    snprintf(name, len, "%s/scratch-XXXXXX", dir);
    *fd = mkostemp(name, O_CLOEXEC);
    int rc =
        *fd >= 0 ? CM_OK : cm_err_errno(errptr, CM_EIO, "cannot create a scratch file in %s", dir);
    if (rc == CM_OK) unlink(name);
    free(name);
    return rc;
}

int cm_fd_each_chunk(int fd, const char *path, uint64_t len,
                     void (*fn)(void *arg, const void *buf, size_t n), void *arg, char **errptr)
{
    enum { CHUNK = 1 << 20 };
    uint8_t *buf = malloc(CHUNK);
    if (buf == NULL) return cm_err(errptr, CM_ENOMEM, "out of memory");
    int rc = CM_OK;
    for (uint64_t off = 0; off < len;) {
        size_t n = len - off < CHUNK ? (size_t)(len - off) : CHUNK;
        ssize_t k = pread(fd, buf, n, (off_t)off);
        if (k < 0 && errno == EINTR) continue;
        if (k <= 0) {
            rc = cm_err_errno(errptr, CM_EIO, "cannot read back %s at offset %" PRIu64, path, off);
            break;
        }
        fn(arg, buf, (size_t)k);
        off += (uint64_t)k;
    }
    free(buf);
    return rc;
}

int cm_self_exe(char *buf, size_t n, char **errptr)
{
    ssize_t got = n > 1 ? readlink("/proc/self/exe", buf, n - 1) : -1;
    if (got <= 0) return cm_err_errno(errptr, CM_EIO, "cannot read /proc/self/exe");
    if ((size_t)got >= n - 1) return cm_err(errptr, CM_EINVAL, "the binary's path is too long");
    buf[got] = '\0';
    return CM_OK;
}

int cm_read_file(const char *path, void **buf, size_t *len, char **errptr)
{
    int fd = open(path, O_RDONLY);
    if (fd < 0)
        return cm_err_errno(errptr, errno == ENOENT ? CM_ENOTFOUND : CM_EIO, "cannot open %s",
                            path);
    int rc = CM_OK;
    char *data = NULL;
    struct stat st;
    if (fstat(fd, &st) != 0) {
        rc = cm_err_errno(errptr, CM_EIO, "cannot stat %s", path);
        goto out;
    }
    size_t size = (size_t)st.st_size, got = 0;
    data = malloc(size + 1); /* +1: callers may NUL-terminate text */
    if (data == NULL) {
        rc = cm_err(errptr, CM_ENOMEM, "out of memory reading %s (%zu bytes)", path, size);
        goto out;
    }
    while (got < size) {
        ssize_t r = read(fd, data + got, size - got);
        if (r < 0 && errno == EINTR) continue;
        if (r < 0) {
            rc = cm_err_errno(errptr, CM_EIO, "cannot read %s", path);
            goto out;
        }
        if (r == 0) break;
        got += (size_t)r;
    }
    data[got] = '\0';
    *buf = data;
    *len = got;
    data = NULL;
out:
    free(data);
    close(fd);
    return rc;
}

int cm_afile_open(cm_afile *f, const char *path, char **errptr)
{
    memset(f, 0, sizeof *f);
    f->fd = -1;
    /* A target that exists and is no regular file (/dev/null, a pipe, a terminal) is written
     * in place: renaming a temporary over it would replace the device with a plain file. A
     * symbolic link to a file is followed: the file it names is replaced, the link stays
     * (renamed over, the link itself became a plain file: `--out /dev/stdout` with stdout on
     * a file replaced the system's /dev/stdout link when run as root). */
    struct stat st, lst;
    const bool in_place = stat(path, &st) == 0 && !S_ISREG(st.st_mode);
    const bool link = !in_place && lstat(path, &lst) == 0 && S_ISLNK(lst.st_mode);
    f->path = link ? realpath(path, NULL) : strdup(path);
    if (link && f->path == NULL) {
        int rc = cm_err_errno(errptr, CM_EIO, "cannot follow the symbolic link %s", path);
        cm_afile_abort(f);
        return rc;
    }
    size_t n = (f->path ? strlen(f->path) : 0) + 32;
    f->tmp = malloc(n);
    f->hash = XXH3_createState();
    if (f->path == NULL || f->tmp == NULL || f->hash == NULL) {
        cm_afile_abort(f);
        return cm_err(errptr, CM_ENOMEM, "out of memory");
    }
    XXH3_64bits_reset(f->hash);
    if (in_place) {
        f->in_place = 1;
        snprintf(f->tmp, n, "%s", f->path);
        f->fd = open(f->path, O_WRONLY | O_CLOEXEC);
    } else {
        snprintf(f->tmp, n, "%s.tmp.%ld", f->path, (long)getpid());
        f->fd = open(f->tmp, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    }
    if (f->fd < 0) {
        int rc = cm_err_errno(errptr, CM_EIO, "cannot create %s", f->tmp);
        cm_afile_abort(f);
        return rc;
    }
    return CM_OK;
}

/* ---- direct I/O ----
 *
 * Two aligned stages: the caller fills one while the other is written by a POSIX AIO write
 * (glibc runs it on its own thread), so the caller never waits on the device unless it
 * outruns it. Every stage write names its file offset, so the file position is set only when
 * direct I/O is left (the file system refused it) and buffered writes continue. */

/* Waits for the stage write in flight, if any; 0 or an errno value (EINVAL: direct refused). A
 * short write is finished synchronously. */
static int aio_finish(cm_afile *f)
{
    struct aiocb *cb = f->aio;
    if (!f->in_flight) return 0;
    f->in_flight = 0;
    int e;
    while ((e = aio_error(cb)) == EINPROGRESS)
        aio_suspend((const struct aiocb *const *)&cb, 1, NULL);
    ssize_t k = aio_return(cb);
    if (e != 0) return e;
    size_t n = cb->aio_nbytes;
    return (size_t)k < n ? cm_pwrite_full(f->fd, (const uint8_t *)cb->aio_buf + k, n - (size_t)k,
                                          (uint64_t)cb->aio_offset + (uint64_t)k)
                         : 0;
}

/* Leaves direct I/O for good after the file system refused a direct write: the stage in
 * flight (when failed is set) and the stage being filled are written buffered, the file
 * position is set after them, and the stages are released. 0 or an errno value. */
static int direct_leave(cm_afile *f, int failed)
{
    int fl = fcntl(f->fd, F_GETFL), e = 0;
    if (fl < 0 || fcntl(f->fd, F_SETFL, fl & ~O_DIRECT) != 0) e = errno;
    struct aiocb *cb = f->aio;
    if (e == 0 && failed)
        e = cm_pwrite_full(f->fd, (const uint8_t *)cb->aio_buf, cb->aio_nbytes,
                           (uint64_t)cb->aio_offset);
    if (e == 0) e = cm_pwrite_full(f->fd, f->stage, f->staged, f->off);
    if (e == 0 && lseek(f->fd, (off_t)(f->off + f->staged), SEEK_SET) < 0) e = errno;
    free(f->stage);
    free(f->spare);
    f->stage = f->spare = NULL;
    f->staged = f->stage_cap = 0;
    return e;
}

/* Starts writing the full stage and switches to the other one; with final set, writes what
 * is staged synchronously instead (whole units direct, the file's last partial unit
 * buffered) after the write in flight has finished. */
static int stage_flush(cm_afile *f, int final, char **errptr)
{
    int e = aio_finish(f);
    if (e == EINVAL) {
        e = direct_leave(f, 1);
    } else if (e == 0 && final) {
        size_t whole = f->staged & ~(size_t)(CM_DIRECT_ALIGN - 1);
        e = cm_pwrite_full(f->fd, f->stage, whole, f->off);
        if (e == 0) {
            f->off += whole;
            f->staged -= whole;
            memmove(f->stage, f->stage + whole, f->staged);
        }
        if (e == 0 || e == EINVAL) e = direct_leave(f, 0);
    } else if (e == 0) {
        struct aiocb *cb = f->aio;
        memset(cb, 0, sizeof *cb);
        cb->aio_fildes = f->fd;
        cb->aio_buf = f->stage;
        cb->aio_nbytes = f->staged;
        cb->aio_offset = (off_t)f->off;
        if (aio_write(cb) != 0) { /* no background write to be had (EAGAIN): write it now */
            e = cm_pwrite_full(f->fd, f->stage, f->staged, f->off);
            if (e == EINVAL) e = direct_leave(f, 0);
        } else {
            f->in_flight = 1;
        }
        if (f->stage != NULL) {
            uint8_t *t = f->stage;
            f->stage = f->spare;
            f->spare = t;
            f->off += f->staged;
            f->staged = 0;
        }
    }
    if (e != 0) {
        errno = e;
        return cm_err_errno(errptr, CM_EIO, "cannot write %s", f->tmp);
    }
    return CM_OK;
}

int cm_afile_open_direct(cm_afile *f, const char *path, size_t stage, char **errptr)
{
    int rc = cm_afile_open(f, path, errptr);
    if (rc != CM_OK || stage < CM_DIRECT_ALIGN || f->in_place) return rc;
    stage &= ~(size_t)(CM_DIRECT_ALIGN - 1);
    void *a = NULL, *b = NULL;
    f->aio = calloc(1, sizeof(struct aiocb));
    int fl = fcntl(f->fd, F_GETFL);
    if (f->aio == NULL || fl < 0 || posix_memalign(&a, CM_DIRECT_ALIGN, stage) != 0 ||
        posix_memalign(&b, CM_DIRECT_ALIGN, stage) != 0 ||
        fcntl(f->fd, F_SETFL, fl | O_DIRECT) != 0) {
        free(a); /* buffered writes, then */
        free(b);
        return CM_OK;
    }
    f->stage = a;
    f->spare = b;
    f->stage_cap = stage;
    return CM_OK;
}

int cm_afile_write(cm_afile *f, const void *buf, size_t n, char **errptr)
{
    const uint8_t *p = buf;
    XXH3_64bits_update(f->hash, buf, n);
    f->bytes += n;
    while (f->stage != NULL && n > 0) {
        size_t k = f->stage_cap - f->staged < n ? f->stage_cap - f->staged : n;
        memcpy(f->stage + f->staged, p, k);
        f->staged += k;
        p += k;
        n -= k;
        int rc = f->staged == f->stage_cap ? stage_flush(f, 0, errptr) : CM_OK;
        if (rc != CM_OK) return rc;
    }
    if (n > 0 && cm_write_full(f->fd, p, n) != CM_OK)
        return cm_err_errno(errptr, CM_EIO, "cannot write %s", f->tmp);
    return CM_OK;
}

uint64_t cm_afile_size(const cm_afile *f)
{
    return f->bytes;
}

uint64_t cm_afile_digest(const cm_afile *f)
{
    return XXH3_64bits_digest(f->hash);
}

static void afile_release(cm_afile *f)
{
    free(f->path);
    free(f->tmp);
    free(f->stage);
    free(f->spare);
    free(f->aio);
    if (f->hash) XXH3_freeState(f->hash);
    memset(f, 0, sizeof *f);
    f->fd = -1;
}

int cm_afile_commit(cm_afile *f, char **errptr)
{
    int rc = CM_OK;
    if (f->stage != NULL && (rc = stage_flush(f, 1, errptr)) != CM_OK) goto fail;
    if (f->in_place) {
        if (close(f->fd) != 0) rc = cm_err_errno(errptr, CM_EIO, "cannot close %s", f->tmp);
        f->fd = -1;
        afile_release(f);
        return rc;
    }
    if (fsync(f->fd) != 0) {
        rc = cm_err_errno(errptr, CM_EIO, "cannot fsync %s", f->tmp);
        goto fail;
    }
    if (close(f->fd) != 0) {
        f->fd = -1;
        rc = cm_err_errno(errptr, CM_EIO, "cannot close %s", f->tmp);
        goto fail;
    }
    f->fd = -1;
    if (rename(f->tmp, f->path) != 0) {
        rc = cm_err_errno(errptr, CM_EIO, "cannot rename %s to %s", f->tmp, f->path);
        goto fail;
    }
    char *dir = strdup(f->path);
    if (dir == NULL) {
        afile_release(f);
        return cm_err(errptr, CM_ENOMEM, "out of memory");
    }
    char *slash = strrchr(dir, '/');
    if (slash == dir)
        slash[1] = '\0';
    else if (slash)
        *slash = '\0';
    rc = cm_fsync_dir(slash ? dir : ".", errptr);
    free(dir);
    afile_release(f);
    return rc;
fail:
    cm_afile_abort(f);
    return rc;
}

int cm_afile_commit_digest(cm_afile *f, int rc, char **errptr)
{
    if (rc == CM_OK) {
        uint64_t digest = cm_afile_digest(f);
        rc = cm_afile_write(f, &digest, sizeof digest, errptr);
    }
    if (rc == CM_OK) return cm_afile_commit(f, errptr);
    cm_afile_abort(f);
    return rc;
}

void cm_afile_abort(cm_afile *f)
{
    aio_finish(f); /* its buffer is about to be freed */
    if (f->fd >= 0) close(f->fd);
    if (f->tmp && !f->in_place) unlink(f->tmp);
    afile_release(f);
}

int cm_write_file_atomic(const char *path, const void *buf, size_t n, char **errptr)
{
    cm_afile f;
    int rc = cm_afile_open(&f, path, errptr);
    if (rc != CM_OK) return rc;
    rc = cm_afile_write(&f, buf, n, errptr);
    if (rc != CM_OK) {
        cm_afile_abort(&f);
        return rc;
    }
    return cm_afile_commit(&f, errptr);
}

int cm_write_sealed(const char *path, const char *text, size_t n, char **errptr)
{
    if (n == 0 || text[n - 1] != '\n')
        return cm_err(errptr, CM_EINVAL, "%s: sealed text must end with a newline", path);
    char line[CM_SEAL_LINE + 1];
    snprintf(line, sizeof line, "xxh3 %016" PRIx64 "\n", cm_xxh3(text, n));
    cm_afile f;
    int rc = cm_afile_open(&f, path, errptr);
    if (rc != CM_OK) return rc;
    rc = cm_afile_write(&f, text, n, errptr);
    if (rc == CM_OK) rc = cm_afile_write(&f, line, CM_SEAL_LINE, errptr);
    if (rc != CM_OK) {
        cm_afile_abort(&f);
        return rc;
    }
    return cm_afile_commit(&f, errptr);
}

int cm_seal_check(const char *buf, size_t n, const char *tag, size_t *body)
{
    const size_t tl = strlen(tag), line = tl + 1 + 16 + 1;
    /* Text: a NUL byte would end the readers' parsing early, whatever the checksum says. */
    if (n < line || memchr(buf, '\0', n) != NULL) return CM_ENOTFOUND;
    const char *l = buf + n - line;
    if ((l > buf && l[-1] != '\n') || memcmp(l, tag, tl) != 0 || l[tl] != ' ' ||
        l[line - 1] != '\n')
        return CM_ENOTFOUND;
    uint64_t want = 0;
    for (size_t i = tl + 1; i < line - 1; i++) {
        const char c = l[i];
        const int d = c >= '0' && c <= '9'   ? c - '0'
                      : c >= 'a' && c <= 'f' ? c - 'a' + 10
                      : c >= 'A' && c <= 'F' ? c - 'A' + 10
                                             : -1;
        if (d < 0) return CM_ENOTFOUND;
        want = want << 4 | (uint64_t)d;
    }
    if (cm_xxh3(buf, n - line) != want) return CM_ECORRUPT;
    *body = n - line;
    return CM_OK;
}

int cm_seal_append(char *out, size_t len, size_t cap, const char *tag)
{
    if (len >= cap) return -1;
    int t = snprintf(out + len, cap - len, "%s %016" PRIx64 "\n", tag, cm_xxh3(out, len));
    return t < 0 || len + (size_t)t >= cap ? -1 : (int)(len + (size_t)t);
}

int cm_read_sealed(const char *path, char **text, size_t *len, char **errptr)
{
    char *buf = NULL;
    size_t n = 0;
    int rc = cm_read_file(path, (void **)&buf, &n, errptr);
    if (rc != CM_OK) return rc;
    rc = cm_seal_check(buf, n, "xxh3", &n);
    if (rc == CM_ENOTFOUND)
        rc = cm_err(errptr, CM_ECORRUPT,
                    "%s: no checksum line at its end (cut short, or from an ember before "
                    "checksummed text files)",
                    path);
    else if (rc != CM_OK)
        rc = cm_err(errptr, CM_ECORRUPT, "%s: checksum mismatch: the file is damaged", path);
    if (rc != CM_OK) {
        free(buf);
        return rc;
    }
    buf[n] = '\0';
    *text = buf;
    *len = n;
    return CM_OK;
}

void cm_json_escape(FILE *f, const char *s)
{
    for (const unsigned char *p = (const unsigned char *)s; *p; p++) {
        if (*p == '"' || *p == '\\')
            fprintf(f, "\\%c", *p);
        else if (*p == '\n')
            fputs("\\n", f);
        else if (*p < 0x20)
            fprintf(f, "\\u%04x", *p);
        else
            fputc(*p, f);
    }
}
