/*
 * serve_formats: `ember export --format rocksdb|safetensors` hold what the bundle serves.
 *   - rocksdb: each table's database (out/<table>, read with the RocksDB C API, read-only) has
 *     exactly the bundle's rows: key = 8 big-endian bytes, value = {u64 key, dim fp32}, equal to
 *     ember_serve_lookup; absent keys are absent; out/model.txt and out/tower.f32 equal the
 *     bundle's model and dense tower.
 *   - safetensors: /usr/bin/python3 with numpy parses the file (header, dtypes, shapes, offsets),
 *     dumps row counts, sampled keys with their rows (%.9g, exact for fp32), the model text and
 *     the tower; the C side compares them with ember_serve_lookup and the bundle.
 *   - a --precision other than fp32 with either format, and an unknown --format, are refused.
 * Without numpy the safetensors half cannot run: the test then exits 77 (ctest: skipped) once the
 * RocksDB half has passed.
 */
#include <rocksdb/c.h>
#include <sys/stat.h>

#include "serve_util.h"

static const char *tables[2] = {"emb", "lin"};

static float *bundle_tower(uint64_t *n)
{
    size_t len = 0;
    char *f = su_slurp(su_path("b/dense-tower.bin"), &len);
    *n = 0;
    if (f == NULL || len < 32) {
        free(f);
        return NULL;
    }
    memcpy(n, f + 16, 8);
    float *t = malloc(*n * 4 + 4);
    memcpy(t, f + 24, *n * 4);
    free(f);
    return t;
}

static void check_rocksdb(const ember_serve *h, const float *tower, uint64_t n_tower)
{
    fprintf(stderr, "--- rocksdb\n");
    for (int ti = 0; ti < 2; ti++) {
        int t = ember_serve_table(h, tables[ti]);
        CHECK(t >= 0);
        if (t < 0) continue;
        uint32_t dim = ember_serve_table_dim(h, t);
        uint64_t rows = ember_serve_table_rows(h, t);
        char path[8400];
        snprintf(path, sizeof path, "%s/rdb/%s", su_dir, tables[ti]);
        rocksdb_options_t *o = rocksdb_options_create();
        char *err = NULL;
        rocksdb_t *db = rocksdb_open_for_read_only(o, path, 0, &err);
        CHECK_MSG(db != NULL && err == NULL, "open %s: %s", path, err ? err : "?");
        free(err);
        err = NULL;
        if (db == NULL) {
            rocksdb_options_destroy(o);
            continue;
        }
        rocksdb_readoptions_t *ro = rocksdb_readoptions_create();
        rocksdb_iterator_t *it = rocksdb_create_iterator(db, ro);
        uint64_t n = 0, bad_len = 0, bad_key = 0, prev = 0;
        size_t cap = 1024;
        uint64_t *keys = malloc(cap * 8);
        float *vals = malloc(cap * dim * 4);
        for (rocksdb_iter_seek_to_first(it); rocksdb_iter_valid(it); rocksdb_iter_next(it)) {
            size_t kl = 0, vl = 0;
            const unsigned char *k = (const unsigned char *)rocksdb_iter_key(it, &kl);
            const char *v = rocksdb_iter_value(it, &vl);
            if (kl != 8 || vl != 8 + 4 * (size_t)dim) {
                bad_len++;
                continue;
            }
            uint64_t key = 0, rec_key;
            for (int i = 0; i < 8; i++) key = key << 8 | k[i];
            memcpy(&rec_key, v, 8);
            bad_key += rec_key != key || (n > 0 && key <= prev); /* big-endian: sorted */
            prev = key;
            if (n == cap) {
                cap *= 2;
                keys = realloc(keys, cap * 8);
                vals = realloc(vals, cap * dim * 4);
            }
            keys[n] = key;
            memcpy(vals + n * dim, v + 8, dim * 4);
            n++;
        }
        rocksdb_iter_get_error(it, &err);
        CHECK_MSG(err == NULL, "iterating %s: %s", path, err ? err : "");
        free(err);
        err = NULL;
        float *out = malloc(n * dim * 4 + 4);
        uint8_t *found = malloc(n + 1);
        size_t bad_val = 0, n_found = 0;
        /* one call for all, then calls of 1, 2, ... 40 keys (every pipeline depth) */
        int lrc = ember_serve_lookup(h, t, keys, n, out, found);
        float *out2 = malloc(n * dim * 4 + 4);
        uint8_t *found2 = malloc(n + 1);
        for (uint64_t i = 0, c = 1; lrc == 0 && i < n; i += c, c = c % 40 + 1) {
            uint64_t k = n - i < c ? n - i : c;
            lrc = ember_serve_lookup(h, t, keys + i, k, out2 + i * dim, found2 + i);
        }
        CHECK(lrc == 0 && memcmp(out, out2, n * dim * 4) == 0 && memcmp(found, found2, n) == 0);
        free(out2);
        free(found2);
        if (lrc == 0)
            for (uint64_t i = 0; i < n; i++) {
                n_found += found[i];
                bad_val += memcmp(out + i * dim, vals + i * dim, dim * 4) != 0;
            }
        fprintf(stderr, "    %s: %llu records (bundle %llu rows), %zu found, %zu values differ\n",
                tables[ti], (unsigned long long)n, (unsigned long long)rows, n_found, bad_val);
        CHECK_MSG(n == rows && n_found == n && bad_val == 0 && bad_len == 0 && bad_key == 0,
                  "%s: %llu records of %llu rows, %zu found, %zu values differ, %llu bad lengths, "
                  "%llu bad keys", tables[ti], (unsigned long long)n, (unsigned long long)rows,
                  n_found, bad_val, (unsigned long long)bad_len, (unsigned long long)bad_key);
        /* point gets: a few present keys, and absent ones */
        for (uint64_t i = 0; i < n && i < 2000; i += 97) {
            char kb[8];
            for (int j = 0; j < 8; j++) kb[j] = (char)(keys[i] >> (56 - 8 * j));
            size_t vl = 0;
            char *v = rocksdb_get(db, ro, kb, 8, &vl, &err);
            CHECK(err == NULL && v != NULL && vl == 8 + 4 * (size_t)dim &&
                  memcmp(v + 8, vals + i * dim, dim * 4) == 0);
            free(v);
            free(err);
            err = NULL;
        }
        uint64_t absent[3] = {0, UINT64_MAX, 0x5a5a5a5a5a5a5a5aull};
        for (int i = 0; i < 3; i++) {
            uint8_t f = 1;
            float row[64];
            ember_serve_lookup(h, t, &absent[i], 1, row, &f);
            char kb[8];
            for (int j = 0; j < 8; j++) kb[j] = (char)(absent[i] >> (56 - 8 * j));
            size_t vl = 0;
            char *v = rocksdb_get(db, ro, kb, 8, &vl, &err);
            CHECK((v == NULL) == (f == 0));
            free(v);
            free(err);
            err = NULL;
        }
        free(out);
        free(found);
        free(keys);
        free(vals);
        rocksdb_iter_destroy(it);
        rocksdb_readoptions_destroy(ro);
        rocksdb_close(db);
        rocksdb_options_destroy(o);
    }
    char *model = su_slurp(su_path("rdb/model.txt"), NULL);
    CHECK_MSG(model && strcmp(model, ember_serve_model(h)) == 0, "rdb/model.txt differs");
    free(model);
    size_t tl = 0;
    char *tw = su_slurp(su_path("rdb/tower.f32"), &tl);
    CHECK_MSG(tw && tl == n_tower * 4 && memcmp(tw, tower, tl) == 0, "rdb/tower.f32 differs");
    free(tw);
}

static const char *py_script =
    "import json, struct, sys\n"
    "import numpy as np\n"
    "path, out, n_sample = sys.argv[1], sys.argv[2], int(sys.argv[3])\n"
    "data = open(path, 'rb').read()\n"
    "(hl,) = struct.unpack('<Q', data[:8])\n"
    "hdr = json.loads(data[8:8 + hl].decode('utf-8'))\n"
    "body = data[8 + hl:]\n"
    "meta = hdr.pop('__metadata__', {})\n"
    "dt = {'U64': np.dtype('<u8'), 'F32': np.dtype('<f4')}\n"
    "ends = sorted((v['data_offsets'][0], v['data_offsets'][1]) for v in hdr.values())\n"
    "assert ends[0][0] == 0 and ends[-1][1] == len(body), 'tensors must tile the body'\n"
    "assert all(a[1] == b[0] for a, b in zip(ends, ends[1:])), 'gaps between tensors'\n"
    "def get(name):\n"
    "    v = hdr[name]\n"
    "    a, b = v['data_offsets']\n"
    "    arr = np.frombuffer(body[a:b], dtype=dt[v['dtype']])\n"
    "    return arr.reshape(v['shape'])\n"
    "rng = np.random.default_rng(7)\n"
    "with open(out, 'w') as f:\n"
    "    f.write('step %s\\n' % meta.get('step'))\n"
    "    for name in sorted(k[:-5] for k in hdr if k.endswith('.keys')):\n"
    "        keys, w = get(name + '.keys'), get(name + '.weights')\n"
    "        assert w.ndim == 2 and w.shape[0] == keys.shape[0], 'shapes'\n"
    "        assert len(np.unique(keys)) == len(keys), 'duplicate keys'\n"
    "        f.write('count %s %d %d\\n' % (name, keys.shape[0], w.shape[1]))\n"
    "        idx = rng.choice(len(keys), size=min(n_sample, len(keys)), replace=False)\n"
    "        for i in sorted(set(idx.tolist()) | {0, len(keys) - 1}):\n"
    "            f.write('row %s %d %s\\n' % (name, int(keys[i]),\n"
    "                    ' '.join('%.9g' % float(x) for x in w[i])))\n"
    "    get('tower').astype('<f4').tofile(out + '.tower')\n"
    "    open(out + '.model', 'w').write(meta.get('model', ''))\n";

/* 0 when checked, 77 when numpy is missing */
static int check_safetensors(const ember_serve *h, const float *tower, uint64_t n_tower)
{
    fprintf(stderr, "--- safetensors\n");
    if (su_shell(60, "/usr/bin/python3 -c 'import numpy'") != 0) {
        fprintf(stderr, "SKIP: /usr/bin/python3 with numpy is needed to read the safetensors "
                        "export (apt-get install python3-numpy)\n");
        return 77;
    }
    FILE *f = fopen(su_path("st_check.py"), "w");
    CHECK(f != NULL);
    if (f == NULL) return 0;
    fputs(py_script, f);
    fclose(f);
    int rc = su_shell(120, "/usr/bin/python3 st_check.py m.safetensors st.txt 3000");
    if (rc != 0) {
        char *e = su_slurp(su_path("err.txt"), NULL);
        fprintf(stderr, "%s\n", e ? e : "");
        free(e);
    }
    CHECK_MSG(rc == 0, "python safetensors check: exit %d", rc);
    if (rc != 0) return 0;
    char *text = su_slurp(su_path("st.txt"), NULL);
    CHECK(text != NULL);
    if (text == NULL) return 0;
    char stepline[64];
    snprintf(stepline, sizeof stepline, "step %llu\n", (unsigned long long)ember_serve_step(h));
    CHECK_MSG(strncmp(text, stepline, strlen(stepline)) == 0, "metadata step: %.40s", text);
    size_t rows_checked[2] = {0, 0}, bad = 0, counts = 0;
    for (char *line = text, *nl; line && *line; line = nl ? nl + 1 : NULL) {
        nl = strchr(line, '\n');
        if (nl) *nl = '\0';
        char name[64];
        unsigned long long a, b;
        int used = 0;
        if (sscanf(line, "count %63s %llu %llu", name, &a, &b) == 3) {
            int t = ember_serve_table(h, name);
            CHECK_MSG(t >= 0 && ember_serve_table_rows(h, t) == a && ember_serve_table_dim(h, t) == b,
                      "safetensors table %s: %llu x %llu", name, a, b);
            counts++;
        } else if (sscanf(line, "row %63s %llu %n", name, &a, &used) == 2) {
            int t = ember_serve_table(h, name);
            if (t < 0) {
                bad++;
                continue;
            }
            uint32_t dim = ember_serve_table_dim(h, t);
            float row[256], want[256];
            uint8_t found = 0;
            uint64_t key = a;
            ember_serve_lookup(h, t, &key, 1, row, &found);
            char *p = line + used;
            for (uint32_t j = 0; j < dim && j < 256; j++) want[j] = strtof(p, &p);
            int ok = found && memcmp(row, want, dim * 4) == 0;
            bad += !ok;
            rows_checked[t == ember_serve_table(h, "emb") ? 0 : 1]++;
        }
    }
    free(text);
    fprintf(stderr, "    %zu tables, rows checked: emb %zu lin %zu, %zu differ\n", counts,
            rows_checked[0], rows_checked[1], bad);
    CHECK(counts == 2 && rows_checked[0] > 1000 && rows_checked[1] > 1000 && bad == 0);
    size_t tl = 0;
    char *tw = su_slurp(su_path("st.txt.tower"), &tl);
    CHECK_MSG(tw && tl == n_tower * 4 && memcmp(tw, tower, tl) == 0, "safetensors tower differs");
    free(tw);
    char *model = su_slurp(su_path("st.txt.model"), NULL);
    CHECK_MSG(model && strcmp(model, ember_serve_model(h)) == 0, "safetensors model: %s",
              model ? model : "(missing)");
    free(model);
    return 0;
}

int main(void)
{
    if (su_init("serve_formats") != 0) return check_done();
    if (su_make_data(20000, 9) != 0 || su_train("deepfm") != 0) return check_done();
    int rc = su_ember("export --checkpoint run-deepfm --out b");
    CHECK(rc == 0);
    rc |= su_ember("export --checkpoint run-deepfm --out m.safetensors --format safetensors");
    CHECK(rc == 0);
    /* An earlier export's extra table does not stay beside this one's (the folder is swapped
     * in whole), and a folder holding something else is refused, left as it was. */
    rc |= su_shell(10, "mkdir -p rdb/old mine && echo x > rdb/old/f && echo keep > mine/notes && "
                       ": > rdb/model.txt && : > rdb/tower.f32");
    rc |= su_ember("export --checkpoint run-deepfm --out rdb --format rocksdb");
    CHECK(rc == 0);
    struct stat sb;
    CHECK_MSG(stat(su_path("rdb/old"), &sb) != 0, "rdb/old of an earlier export is still there");
    int mine = su_ember("export --checkpoint run-deepfm --out mine --format rocksdb");
    char *me = su_slurp(su_path("err.txt"), NULL);
    int mineb = su_ember("export --checkpoint run-deepfm --out mine");
    char *keep = su_slurp(su_path("mine/notes"), NULL);
    CHECK_MSG(mine != 0 && mineb != 0 && keep && !strcmp(keep, "keep\n") &&
                  stat(su_path("mine/tower.f32"), &sb) != 0 && me &&
                  strstr(me, "holds something other than an earlier output"),
              "export into a folder of other files: exit %d / %d, %s", mine, mineb,
              me ? me : "(no message)");
    free(keep);
    free(me);
    if (rc != 0) return check_done();
    /* A precision safetensors or RocksDB cannot store is refused, not ignored (the file said
     * fp32 and exit 0), and an unknown format is named: exit 2, nothing written. */
    const char *refused[][2] = {
        {"--out x.safetensors --format safetensors --precision int8",
         "--precision int8 needs --format bundle"},
        {"--out xr --format rocksdb --precision fp16", "--precision fp16 needs --format bundle"},
        {"--out xf --format onnx", "unknown --format 'onnx'"}};
    for (size_t i = 0; i < sizeof refused / sizeof refused[0]; i++) {
        int r = su_ember("export --checkpoint run-deepfm %s", refused[i][0]);
        char *err = su_slurp(su_path("err.txt"), NULL);
        CHECK_MSG(r == 2 && err && strstr(err, refused[i][1]), "export %s: exit %d, %s",
                  refused[i][0], r, err ? err : "(no message)");
        free(err);
    }
    CHECK(access(su_path("x.safetensors"), F_OK) != 0 && access(su_path("xr"), F_OK) != 0 &&
          access(su_path("xf"), F_OK) != 0);
    ember_serve *h = su_open(su_path("b"), NULL);
    uint64_t n_tower = 0;
    float *tower = bundle_tower(&n_tower);
    CHECK(tower != NULL && n_tower > 0);
    int skip = 0;
    if (h && tower) {
        check_rocksdb(h, tower, n_tower);
        skip = check_safetensors(h, tower, n_tower) == 77;
    }
    ember_serve_close(h);
    free(tower);
    int r = check_done();
    return r == 0 && skip ? 77 : r;
}
