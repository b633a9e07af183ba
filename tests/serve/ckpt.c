/*
 * serve_ckpt: what `ember export` and `ember reshard` take from the checkpoint they are given.
 *   - a checkpoint of 2 shards with shard-1 gone (a partial copy) is refused, naming shard-1,
 *     not exported or resharded as half its rows; so is one whose shard-1 is another shard's
 *     copy (its MANIFEST names shard 0);
 *   - a checkpoint named with a trailing slash (shell completion: run/ckpt/step-32/) exports at
 *     its step, not at step 0, and reshards to ckpt/step-32;
 *   - an --out with a trailing slash (bs/) is written (bundle and RocksDB), fresh and over an
 *     earlier export;
 *   - a checkpoint copied under another name exports at worker 0's step, not 0; a staging
 *     folder (step-N.tmp, an interrupted save's) is refused by export and reshard;
 *   - a key twice in one shard's snapshot (every checksum made to match) is refused by export
 *     in each format and as a delta, naming the snapshot and the key, and nothing is written;
 *   - export, reshard and predict name paths holding a quote and a backslash as JSON strings;
 *   - predict on shards of another schema than the bundle's model names both.
 */
#include <inttypes.h>

#include "serve_util.h"

/* The "step" of `ember export`'s JSON line in su_dir/out.txt, or -1. */
static long long export_step(void)
{
    char *out = su_slurp(su_path("out.txt"), NULL);
    const char *s = out ? strstr(out, "\"step\":") : NULL;
    long long v = s ? atoll(s + 7) : -1;
    free(out);
    return v;
}

/* The JSON string value of "key" in out.txt's JSON line, unescaped into v; -1 when missing or
 * not a well-formed JSON string (a raw quote ends it early, a raw control character or a stray
 * backslash is refused). */
static int json_string(const char *key, char *v, size_t cap)
{
    char *out = su_slurp(su_path("out.txt"), NULL), pat[64];
    snprintf(pat, sizeof pat, "\"%s\":\"", key);
    const char *p = out ? strstr(out, pat) : NULL;
    int rc = -1;
    size_t n = 0;
    for (p = p ? p + strlen(pat) : NULL; p && *p && n + 1 < cap; p++) {
        if (*p == '"') {
            rc = p[1] == ',' || p[1] == '}' ? 0 : -1; /* the value must end the member */
            break;
        }
        if ((unsigned char)*p < 0x20) break;
        if (*p == '\\') {
            p++;
            if (*p == '"' || *p == '\\' || *p == '/')
                v[n++] = *p;
            else if (*p == 'n')
                v[n++] = '\n';
            else
                break;
        } else {
            v[n++] = *p;
        }
    }
    v[n] = '\0';
    free(out);
    return rc;
}

static int err_names(const char *needle)
{
    char *err = su_slurp(su_path("err.txt"), NULL);
    int ok = err && strstr(err, needle);
    if (!ok) fprintf(stderr, "stderr '%s' does not name '%s'\n", err ? err : "", needle);
    free(err);
    return ok;
}

/* Gives record 1 of the table snapshot at dir record 0's key (in *key), then makes rows.bin's
 * trailer and the MANIFEST's file line and checksum match: a consistent lie that no checksum
 * catches. 0, or -1 when a file is not what a snapshot holds. */
static int key_twice(const char *dir, uint64_t *key)
{
    char rows[4200], mf[4200], out[8192];
    snprintf(rows, sizeof rows, "%s/rows.bin", su_path(dir));
    snprintf(mf, sizeof mf, "%s/MANIFEST", su_path(dir));
    size_t len = 0, mlen = 0, body = 0;
    uint8_t *b = (uint8_t *)su_slurp(rows, &len);
    char *m = su_slurp(mf, &mlen);
    uint32_t rb = 0;
    if (b != NULL && len >= 32) memcpy(&rb, b + 20, 4);
    const char *at = m && cm_seal_check(m, mlen, "checksum", &body) == CM_OK
                         ? strstr(m, "\nfile rows.bin ")
                         : NULL;
    int rc = -1;
    if (at != NULL && rb >= 8 && len >= 32 + 2 * (size_t)rb + 8) {
        memcpy(key, b + 32, 8);
        memcpy(b + 32 + rb, key, 8);
        uint64_t h = cm_xxh3(b, len - 8);
        memcpy(b + len - 8, &h, 8);
        const char *end = strchr(at + 1, '\n') + 1;
        int n = snprintf(out, sizeof out, "%.*s\nfile rows.bin %zu %016" PRIx64 "\n%.*s",
                         (int)(at - m), m, len, h, (int)(m + body - end), end);
        n = n > 0 ? cm_seal_append(out, (size_t)n, sizeof out, "checksum") : -1;
        if (n > 0 && cm_write_file_atomic(rows, b, len, NULL) == CM_OK &&
            cm_write_file_atomic(mf, out, (size_t)n, NULL) == CM_OK)
            rc = 0;
    }
    free(b);
    free(m);
    return rc;
}

int main(void)
{
    char v0[64];
    if (su_init("serve_ckpt") != 0) return check_done();
    if (su_make_data(30000, 5) != 0) return check_done();
    int rc = su_ember("train --train shards/train --eval shards/eval --model lr --out run "
                      "--no-progress --max-steps 40 --checkpoint-every 20 --batch 512 "
                      "--device cpu --shards 2");
    CHECK_MSG(rc == 0, "train: exit %d", rc);
    if (rc != 0) return check_done();

    fprintf(stderr, "--- a shard missing\n");
    rc = su_shell(30, "cp -r run/ckpt/step-40 half && rm -rf half/shard-1");
    CHECK(rc == 0);
    rc = su_ember("export --checkpoint half --out b-half");
    CHECK_MSG(rc == 1 && err_names("shard-1"), "export of a checkpoint without shard-1: exit %d",
              rc);
    CHECK_MSG(access(su_path("b-half"), F_OK) != 0, "b-half written");
    rc = su_ember("reshard --from half --shards 3 --out rs-half");
    CHECK_MSG(rc != 0 && err_names("shard-1"), "reshard of a checkpoint without shard-1: exit %d",
              rc);
    CHECK_MSG(access(su_path("rs-half/ckpt/LATEST"), F_OK) != 0, "rs-half/ckpt/LATEST written");

    fprintf(stderr, "--- a shard that is another's copy\n");
    rc = su_shell(30, "cp -r run/ckpt/step-40 dup && rm -rf dup/shard-1 && "
                      "cp -r dup/shard-0 dup/shard-1");
    CHECK(rc == 0);
    rc = su_ember("export --checkpoint dup --out b-dup");
    CHECK_MSG(rc == 1 && err_names("shard-1"), "export of shard-0 twice: exit %d", rc);

    /* A key twice in one shard's snapshot (checksums all valid): export kept every row, so
     * safetensors held the key twice, RocksDB its last copy, and the bundle's writer refused it
     * naming no file. Each format refuses it naming the snapshot and the key. */
    fprintf(stderr, "--- a key twice in a shard's snapshot\n");
    uint64_t key = 0;
    rc = su_shell(30, "cp -r run/ckpt/step-40 twice");
    CHECK(rc == 0 && key_twice("twice/shard-0/table-lin", &key) == 0);
    char keyname[64];
    snprintf(keyname, sizeof keyname, "key %" PRIu64 " ", key);
    /* The delta too: a key of the old checkpoint twice in the new is caught by the comparison
     * (an unchanged row never reaches the bundle's writer). */
    static const char *const fmts[] = {"bundle", "safetensors", "rocksdb",
                                       "bundle --since run/ckpt/step-20"};
    for (int i = 0; i < 4; i++) {
        rc = su_ember("export --checkpoint twice --out twice-%d --format %s", i, fmts[i]);
        CHECK_MSG(rc == 1 && err_names("twice/shard-0/table-lin") && err_names(keyname),
                  "export --format %s of a key twice: exit %d", fmts[i], rc);
        snprintf(v0, sizeof v0, "twice-%d", i);
        CHECK_MSG(access(su_path(v0), F_OK) != 0, "%s written", v0);
    }

    fprintf(stderr, "--- a trailing slash\n");
    rc = su_ember("export --checkpoint run/ckpt/step-40/ --out b40");
    CHECK_MSG(rc == 0 && export_step() == 40, "export of step-40/: exit %d, step %lld", rc,
              export_step());
    rc = su_ember("export --checkpoint run/ckpt/step-20// --out b20");
    CHECK_MSG(rc == 0 && export_step() == 20, "export of step-20//: exit %d, step %lld", rc,
              export_step());
    rc = su_ember("export --checkpoint run/ckpt/step-40/ --since run/ckpt/step-20/ --out d40");
    CHECK_MSG(rc == 0 && export_step() == 40, "delta step-40/ since step-20/: exit %d", rc);
    ember_serve *h =
        rc == 0 ? su_open(su_path("b20"), (const char *[]){su_path("d40"), NULL}) : NULL;
    CHECK_MSG(h && ember_serve_step(h) == 40, "b20 + d40 serves step %llu",
              h ? (unsigned long long)ember_serve_step(h) : 0ull);
    ember_serve_close(h);
    rc = su_ember("reshard --from run/ckpt/step-40/ --shards 1 --out rs");
    CHECK_MSG(rc == 0, "reshard of step-40/: exit %d", rc);
    char *latest = su_slurp(su_path("rs/ckpt/LATEST"), NULL);
    CHECK_MSG(latest && !strncmp(latest, "step-40\n", 8) &&
                  access(su_path("rs/ckpt/step-40/shard-0/MANIFEST"), F_OK) == 0,
              "reshard of step-40/ wrote LATEST '%s'", latest ? latest : "(none)");
    free(latest);

    fprintf(stderr, "--- --out with a trailing slash\n");
    for (int round = 0; round < 2; round++) {
        rc = su_ember("export --checkpoint run --out bs/");
        CHECK_MSG(rc == 0 && access(su_path("bs/MANIFEST"), F_OK) == 0 &&
                      access(su_path("bs/.tmp"), F_OK) != 0,
                  "round %d: export --out bs/: exit %d", round, rc);
        rc = su_ember("export --checkpoint run --out rdb/ --format rocksdb");
        CHECK_MSG(rc == 0 && access(su_path("rdb/model.txt"), F_OK) == 0,
                  "round %d: export --out rdb/ --format rocksdb: exit %d", round, rc);
    }

    /* A copy under another name goes by worker 0's position (step 40 here, one worker), not
     * step 0; a staging folder (an interrupted save's) is refused, not exported as a step. */
    fprintf(stderr, "--- a checkpoint copied under another name, and a staging folder\n");
    {
        char cmd[4300];
        snprintf(cmd, sizeof cmd,
                 "cd '%s' && cp -r run/ckpt/step-40 best && cp -r run/ckpt/step-40 "
                 "run/ckpt/step-48.tmp",
                 su_dir);
        CHECK(system(cmd) == 0);
    }
    rc = su_ember("export --checkpoint best --out b-best");
    CHECK_MSG(rc == 0 && export_step() == 40, "export of a copy named best: exit %d, step %lld", rc,
              export_step());
    rc = su_ember("export --checkpoint run/ckpt/step-48.tmp --out b-tmp");
    CHECK_MSG(rc != 0 && err_names("being assembled"), "export of a staging folder: exit %d", rc);
    rc = su_ember("reshard --from run/ckpt/step-48.tmp --shards 1 --out r-tmp");
    CHECK_MSG(rc != 0 && err_names("being assembled"), "reshard of a staging folder: exit %d", rc);

    /* The JSON lines name paths as JSON strings: a quote or a backslash in one is escaped. */
    fprintf(stderr, "--- paths with a quote and a backslash in the JSON lines\n");
    static const char odd[] = "q\"b\\s";
    char v[256];
    rc = su_ember("export --checkpoint run --out 'q\"b\\s'");
    CHECK_MSG(rc == 0 && json_string("out", v, sizeof v) == 0 && !strcmp(v, odd),
              "export --out %s: exit %d, out '%s'", odd, rc, v);
    rc = su_ember("reshard --from run --shards 1 --out 'r\"e\\s'");
    CHECK_MSG(rc == 0 && json_string("to", v, sizeof v) == 0 &&
                  !strncmp(v, "r\"e\\s/", 6), /* its checkpoint's step folder */
              "reshard --out r\"e\\s: exit %d, to '%s'", rc, v);
    rc = su_ember("predict --bundle 'q\"b\\s' --data shards/eval --out 'p\"r\\d'");
    CHECK_MSG(rc == 0 && json_string("out", v, sizeof v) == 0 && !strcmp(v, "p\"r\\d"),
              "predict --out p\"r\\d: exit %d, out '%s'", rc, v);

    /* Shards of another schema than the bundle's model: the message named neither the shards
     * nor the bundle ("batch has 1 fields and 0 dense values; the model expects ..."). */
    fprintf(stderr, "--- predict on shards of another schema\n");
    {
        FILE *f = fopen(su_path("other.svm"), "w");
        CHECK(f != NULL);
        if (f) {
            fputs("1 3:1 5:0.5\n0 2:1 7:1\n", f);
            fclose(f);
        }
    }
    rc = su_ember("ingest --format libsvm --out svm other.svm");
    CHECK_MSG(rc == 0, "ingest of other.svm: exit %d", rc);
    rc = su_ember("predict --bundle b40 --data svm/train --out p-svm");
    CHECK_MSG(rc == 1 && err_names("svm/train") && err_names("b40"),
              "predict on shards of another schema: exit %d", rc);
    CHECK_MSG(access(su_path("p-svm"), F_OK) != 0, "p-svm written");

    /* A missing required option is named, not left to the usage text. */
    fprintf(stderr, "--- predict and reshard name the option missing\n");
    static const char *const usage_errors[][2] = {
        {"predict --bundle b --data shards/eval", "--out is required"},
        {"predict --data shards/eval --out p", "--bundle is required"},
        {"predict --bundle b --data shards/eval --out p stray", "unexpected argument 'stray'"},
        {"reshard --from run --out r", "--shards is required"},
        {"reshard --shards 2 --out r", "--from is required"}};
    for (size_t i = 0; i < sizeof usage_errors / sizeof usage_errors[0]; i++) {
        rc = su_ember("%s", usage_errors[i][0]);
        CHECK_MSG(rc == 2 && err_names(usage_errors[i][1]), "%s: exit %d", usage_errors[i][0], rc);
    }
    return check_done();
}
