#define _GNU_SOURCE /* renameat2 */
#include "common/common.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>
#include <xxhash.h>

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

int cm_dir_swap(const char *tmpdir, const char *dir, char **errptr)
{
    struct stat st;
    if (stat(dir, &st) != 0) {
        if (rename(tmpdir, dir) != 0)
            return cm_err_errno(errptr, CM_EIO, "cannot rename %s to %s", tmpdir, dir);
    } else {
        if (renameat2(AT_FDCWD, tmpdir, AT_FDCWD, dir, RENAME_EXCHANGE) != 0)
            return cm_err_errno(errptr, CM_EIO, "cannot swap %s into %s", tmpdir, dir);
        int rc = cm_rmtree(tmpdir, errptr); /* now the previous tree */
        if (rc != CM_OK) return rc;
    }
    char *parent = strdup(dir);
    if (parent == NULL) return cm_err(errptr, CM_ENOMEM, "out of memory");
    char *slash = strrchr(parent, '/');
    if (slash == parent) slash[1] = '\0';
    else if (slash) *slash = '\0';
    int rc = cm_fsync_dir(slash ? parent : ".", errptr);
    free(parent);
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
    size_t n = strlen(path) + 32;
    f->path = strdup(path);
    f->tmp = malloc(n);
    f->hash = XXH3_createState();
    if (f->path == NULL || f->tmp == NULL || f->hash == NULL) {
        cm_afile_abort(f);
        return cm_err(errptr, CM_ENOMEM, "out of memory");
    }
    snprintf(f->tmp, n, "%s.tmp.%ld", path, (long)getpid());
    XXH3_64bits_reset(f->hash);
    f->fd = open(f->tmp, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (f->fd < 0) {
        int rc = cm_err_errno(errptr, CM_EIO, "cannot create %s", f->tmp);
        cm_afile_abort(f);
        return rc;
    }
    return CM_OK;
}

int cm_afile_write(cm_afile *f, const void *buf, size_t n, char **errptr)
{
    if (cm_write_full(f->fd, buf, n) != CM_OK)
        return cm_err_errno(errptr, CM_EIO, "cannot write %s", f->tmp);
    XXH3_64bits_update(f->hash, buf, n);
    f->bytes += n;
    return CM_OK;
}

uint64_t cm_afile_digest(const cm_afile *f)
{
    return XXH3_64bits_digest(f->hash);
}

static void afile_release(cm_afile *f)
{
    free(f->path);
    free(f->tmp);
    if (f->hash) XXH3_freeState(f->hash);
    memset(f, 0, sizeof *f);
    f->fd = -1;
}

int cm_afile_commit(cm_afile *f, char **errptr)
{
    int rc = CM_OK;
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
    if (slash == dir) slash[1] = '\0';
    else if (slash) *slash = '\0';
    rc = cm_fsync_dir(slash ? dir : ".", errptr);
    free(dir);
    afile_release(f);
    return rc;
fail:
    cm_afile_abort(f);
    return rc;
}

void cm_afile_abort(cm_afile *f)
{
    if (f->fd >= 0) close(f->fd);
    if (f->tmp) unlink(f->tmp);
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
