/*
 * cm_afile:
 *   - files written with direct I/O (two aligned stages, the full one written in the
 *     background) are byte for byte the files written buffered, for stage sizes and write
 *     patterns that end on, before and after stage boundaries, and for an empty file; the
 *     size and digest report every byte;
 *   - an abort with stage writes in flight leaves neither the target nor the temporary;
 *   - a target that is no regular file (a FIFO here, as /dev/null would be) is written in
 *     place and is still a FIFO after the commit, not replaced by a plain file;
 *   - a symbolic link to a file (as /dev/stdout is, with stdout on a file) stays a link and
 *     the file it names gets the bytes, also through a chain of two links; a dangling link is
 *     refused and left as it was;
 *   - sealed text (cm_write_sealed) reads back as written, and every damage is refused by
 *     cm_read_sealed with the path named: any one byte flipped, any cut, a missing or extra
 *     last line, an empty file; a missing file is CM_ENOTFOUND.
 */
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <sys/stat.h>
#include <xxhash.h>

#include "check.h"
#include "common/common.h"

static uint64_t rng_state = 42;
static uint32_t rnd(uint32_t n)
{
    rng_state = rng_state * 6364136223846793005ULL + 1442695040888963407ULL;
    return (uint32_t)(rng_state >> 33) % n;
}

/* Writes data[0..n) in pieces of the given sizes (cycled) through an afile; stage 0 = buffered.
 * Returns the digest the afile reported, or 0 on failure. */
static uint64_t write_through(const char *path, const uint8_t *data, size_t n, size_t stage,
                              const size_t *pieces, size_t npieces)
{
    cm_afile f;
    char *err = NULL;
    int rc = stage ? cm_afile_open_direct(&f, path, stage, &err) : cm_afile_open(&f, path, &err);
    CHECK_OK(rc, err);
    if (rc != 0) return 0;
    size_t off = 0;
    for (size_t i = 0; off < n; i++) {
        size_t k = pieces[i % npieces];
        if (k > n - off) k = n - off;
        rc = cm_afile_write(&f, data + off, k, &err);
        CHECK_OK(rc, err);
        if (rc != 0) {
            cm_afile_abort(&f);
            return 0;
        }
        off += k;
    }
    CHECK_MSG(cm_afile_size(&f) == n, "size %llu, wrote %zu", (unsigned long long)cm_afile_size(&f),
              n);
    uint64_t d = cm_afile_digest(&f);
    rc = cm_afile_commit(&f, &err);
    CHECK_OK(rc, err);
    return d;
}

static int same_file(const char *path, const uint8_t *data, size_t n)
{
    void *buf = NULL;
    size_t len = 0;
    char *err = NULL;
    int rc = cm_read_file(path, &buf, &len, &err);
    CHECK_OK(rc, err);
    int same = rc == 0 && len == n && (n == 0 || memcmp(buf, data, n) == 0);
    free(buf);
    return same;
}

static void direct_equals_buffered(const char *dir)
{
    size_t n = 300000;
    uint8_t *data = malloc(n);
    for (size_t i = 0; i < n; i++)
        data[i] = (uint8_t)rnd(256);
    const size_t stages[] = {4096, 8192, 12345, 65536};
    const size_t odd[] = {1, 4095, 0, 4096, 10000, 7, 70000, 333};
    const size_t whole[] = {8192};
    const size_t totals[] = {0, 1, 4096, 3 * 8192, 3 * 8192 + 1, 65536 * 2 - 1, 300000};
    char a[4200], b[4200];
    snprintf(a, sizeof a, "%s/buffered", dir);
    snprintf(b, sizeof b, "%s/direct", dir);
    for (size_t s = 0; s < sizeof stages / sizeof *stages; s++)
        for (size_t t = 0; t < sizeof totals / sizeof *totals; t++)
            for (int p = 0; p < 2; p++) {
                const size_t *pieces = p ? whole : odd;
                size_t np = p ? 1 : sizeof odd / sizeof *odd;
                size_t total = totals[t];
                uint64_t da = write_through(a, data, total, 0, pieces, np);
                uint64_t db = write_through(b, data, total, stages[s], pieces, np);
                CHECK_MSG(same_file(a, data, total), "buffered file differs (total %zu)", total);
                CHECK_MSG(same_file(b, data, total), "direct file differs: stage %zu total %zu %s",
                          stages[s], total, p ? "whole pieces" : "odd pieces");
                CHECK_MSG(da == db && da == XXH3_64bits(data, total),
                          "digest differs: stage %zu total %zu", stages[s], total);
            }
    free(data);
}

static void abort_in_flight(const char *dir)
{
    char path[4200];
    snprintf(path, sizeof path, "%s/aborted", dir);
    uint8_t *data = calloc(1, 1 << 20);
    cm_afile f;
    char *err = NULL;
    int rc = cm_afile_open_direct(&f, path, 8192, &err);
    CHECK_OK(rc, err);
    if (rc == 0) {
        rc = cm_afile_write(&f, data, 1 << 20, &err);
        CHECK_OK(rc, err);
        cm_afile_abort(&f);
    }
    free(data);
    struct stat st;
    CHECK_MSG(stat(path, &st) != 0 && errno == ENOENT, "aborted target exists");
    char cmd[8600];
    snprintf(cmd, sizeof cmd, "ls '%s' | grep -q aborted", dir);
    CHECK_MSG(system(cmd) != 0, "an aborted temporary is left in %s", dir);
}

static void special_target(const char *dir)
{
    char path[4200];
    snprintf(path, sizeof path, "%s/fifo", dir);
    CHECK(mkfifo(path, 0600) == 0);
    int rd = open(path, O_RDONLY | O_NONBLOCK); /* a reader, so the writer's open succeeds */
    CHECK(rd >= 0);
    const char msg[] = "bytes through a pipe\n";
    for (int direct = 0; direct < 2; direct++) {
        cm_afile f;
        char *err = NULL;
        int rc =
            direct ? cm_afile_open_direct(&f, path, 8192, &err) : cm_afile_open(&f, path, &err);
        CHECK_OK(rc, err);
        if (rc != 0) continue;
        rc = cm_afile_write(&f, msg, sizeof msg - 1, &err);
        CHECK_OK(rc, err);
        rc = cm_afile_commit(&f, &err);
        CHECK_OK(rc, err);
        char got[64] = {0};
        ssize_t k = read(rd, got, sizeof got - 1);
        CHECK_MSG(k == (ssize_t)(sizeof msg - 1) && strcmp(got, msg) == 0,
                  "the FIFO's reader got %zd bytes", k);
        struct stat st;
        CHECK_MSG(stat(path, &st) == 0 && S_ISFIFO(st.st_mode),
                  "the FIFO was replaced by a plain file");
    }
    close(rd);
}

static void raw_write(const char *path, const char *buf, size_t n)
{
    FILE *f = fopen(path, "wb");
    CHECK(f != NULL);
    if (f) fwrite(buf, 1, n, f), fclose(f);
}

/* cm_read_sealed of path: 1 when refused as CM_ECORRUPT with the path in the message. */
static int refused(const char *path)
{
    char *text = NULL, *err = NULL;
    size_t len;
    int rc = cm_read_sealed(path, &text, &len, &err);
    int ok = rc == CM_ECORRUPT && err && strstr(err, path) && text == NULL;
    free(text);
    free(err);
    return ok;
}

static void sealed_text(const char *dir)
{
    char path[4096], *text = NULL, *err = NULL;
    snprintf(path, sizeof path, "%s/sealed.txt", dir);
    const char *body = "step 42\nsamples 1000\nloss_sum 0.5\n";
    size_t n = strlen(body), len = 0;
    CHECK(cm_write_sealed(path, body, n, &err) == CM_OK);
    CHECK(cm_read_sealed(path, &text, &len, &err) == CM_OK && len == n && strcmp(text, body) == 0);
    free(text);
    char *raw = NULL;
    size_t rn = 0;
    CHECK(cm_read_file(path, (void **)&raw, &rn, &err) == CM_OK && rn == n + CM_SEAL_LINE);
    int missed = 0;
    for (size_t i = 0; raw && i < rn; i++) /* every byte, the checksum line's included */
        for (int bit = 0; bit < 8; bit += 3) {
            raw[i] ^= (char)(1 << bit);
            raw_write(path, raw, rn);
            missed += !refused(path);
            raw[i] ^= (char)(1 << bit);
        }
    CHECK_MSG(missed == 0, "%d damaged copies read back", missed);
    missed = 0;
    for (size_t cut = 0; raw && cut < rn; cut++) {
        raw_write(path, raw, cut);
        missed += !refused(path);
    }
    CHECK_MSG(missed == 0, "%d cut copies read back", missed);
    if (raw) { /* a line after the checksum's, and the text alone */
        char *more = malloc(rn + 8);
        memcpy(more, raw, rn);
        memcpy(more + rn, "step 9\n", 7);
        raw_write(path, more, rn + 7);
        CHECK(refused(path));
        free(more);
        raw_write(path, body, n);
        CHECK(refused(path));
    }
    free(raw);
    CHECK(cm_write_sealed(path, "no newline", 10, &err) == CM_EINVAL);
    free(err);
    err = NULL;
    snprintf(path, sizeof path, "%s/absent.txt", dir);
    CHECK(cm_read_sealed(path, &text, &len, &err) == CM_ENOTFOUND);
    free(err);
}

/* cm_dir_swap from two threads at once into a directory that does not exist yet: both must
 * succeed and one's tree must be there whole (the second's plain rename failed on the first's
 * new directory while it decided by a stat before renaming). */
typedef struct swapper {
    const char *dir;
    int who, rounds, fails;
    pthread_barrier_t *bar;
} swapper;

static void *swap_loop(void *arg)
{
    swapper *w = arg;
    for (int i = 0; i < w->rounds; i++) {
        char tmp[1200], target[1200], f[1300];
        snprintf(tmp, sizeof tmp, "%s/sw-%d.tmp-%d", w->dir, i, w->who);
        snprintf(target, sizeof target, "%s/sw-%d", w->dir, i);
        snprintf(f, sizeof f, "%s/who", tmp);
        char *err = NULL;
        int rc = cm_mkdirs(tmp, &err);
        if (rc == 0) rc = cm_write_file_atomic(f, &w->who, sizeof w->who, &err);
        pthread_barrier_wait(w->bar);
        if (rc == 0) rc = cm_dir_swap(tmp, target, &err);
        if (rc != 0) {
            if (w->fails++ == 0) fprintf(stderr, "swap %d, thread %d: %s\n", i, w->who, err);
        }
        free(err);
    }
    return NULL;
}

static void dir_swap_race(const char *dir)
{
    enum { ROUNDS = 300 };
    pthread_barrier_t bar;
    pthread_barrier_init(&bar, NULL, 2);
    swapper w[2] = {{dir, 1, ROUNDS, 0, &bar}, {dir, 2, ROUNDS, 0, &bar}};
    pthread_t th[2];
    for (int i = 0; i < 2; i++)
        pthread_create(&th[i], NULL, swap_loop, &w[i]);
    for (int i = 0; i < 2; i++)
        pthread_join(th[i], NULL);
    pthread_barrier_destroy(&bar);
    int whole = 0, left = 0;
    for (int i = 0; i < ROUNDS; i++) {
        char p[1200];
        snprintf(p, sizeof p, "%s/sw-%d/who", dir, i);
        void *b = NULL;
        size_t n = 0;
        char *err = NULL;
        if (cm_read_file(p, &b, &n, &err) == 0 && n == sizeof(int) &&
            (*(int *)b == 1 || *(int *)b == 2))
            whole++;
        free(b);
        free(err);
        for (int t = 1; t <= 2; t++) {
            struct stat st;
            snprintf(p, sizeof p, "%s/sw-%d.tmp-%d", dir, i, t);
            left += stat(p, &st) == 0;
        }
    }
    CHECK_MSG(w[0].fails == 0 && w[1].fails == 0 && whole == ROUNDS && left == 0,
              "racing swaps: %d and %d failed, %d of %d targets whole, %d temporaries left",
              w[0].fails, w[1].fails, whole, ROUNDS, left);
}

/* Writes text to path with cm_write_file_atomic; the call's return code. */
static int write_atomic(const char *path, const char *text, char **err)
{
    return cm_write_file_atomic(path, text, strlen(text), err);
}

static void link_target(const char *dir)
{
    char file[4200], link1[4200], link2[4200], dangling[4200], got[64] = {0};
    snprintf(file, sizeof file, "%s/target.txt", dir);
    snprintf(link1, sizeof link1, "%s/link1", dir);
    snprintf(link2, sizeof link2, "%s/link2", dir);
    snprintf(dangling, sizeof dangling, "%s/dangling", dir);
    char *err = NULL;
    CHECK_OK(write_atomic(file, "old\n", &err), err);
    CHECK(symlink("target.txt", link1) == 0 && symlink(link1, link2) == 0);
    CHECK(symlink("nowhere/none.txt", dangling) == 0);
    const char *via[2] = {link1, link2};
    for (int i = 0; i < 2; i++) {
        char text[32];
        snprintf(text, sizeof text, "new %d\n", i);
        CHECK_OK(write_atomic(via[i], text, &err), err);
        struct stat st;
        CHECK_MSG(lstat(link1, &st) == 0 && S_ISLNK(st.st_mode) && lstat(link2, &st) == 0 &&
                      S_ISLNK(st.st_mode),
                  "writing through %s replaced a link with a plain file", via[i]);
        int fd = open(file, O_RDONLY);
        ssize_t k = fd >= 0 ? read(fd, got, sizeof got - 1) : -1;
        if (fd >= 0) close(fd);
        got[k > 0 ? k : 0] = '\0';
        CHECK_MSG(strcmp(got, text) == 0, "the link's file holds '%s' after writing through %s",
                  got, via[i]);
    }
    int rc = write_atomic(dangling, "x\n", &err);
    CHECK_MSG(rc == CM_EIO && err && strstr(err, "dangling"), "a dangling link: rc %d, %s", rc,
              err ? err : "(none)");
    free(err);
    struct stat st;
    CHECK_MSG(lstat(dangling, &st) == 0 && S_ISLNK(st.st_mode), "the dangling link was replaced");
}

int main(void)
{
    const char *dir = check_tmpdir("common_afile");
    dir_swap_race(dir);
    direct_equals_buffered(dir);
    abort_in_flight(dir);
    special_target(dir);
    link_target(dir);
    sealed_text(dir);
    return check_done();
}
