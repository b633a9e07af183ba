/*
 * The client against bad PULL replies: an in-process shard behind a proxy (raw rep0 in front,
 * raw req0 to the shard) that passes every message unchanged except the PULL replies it is
 * told to spoil, re-sealed so that only their content is wrong:
 *   - a NaN in the rows (fp32 replies, copied straight into the caller's rows, and fp16 ones,
 *     decoded first): the pull fails with an error naming non-finite values;
 *   - a reply one row short: the pull fails naming the byte count;
 * and a clean reply through the same proxy gives the rows the shard itself gives. A failed
 * pull never crashes the client, which goes on serving the next pull.
 */
#include <math.h>
#include <nng/nng.h>
#include <nng/protocol/reqrep0/rep.h>
#include <nng/protocol/reqrep0/req.h>
#include <pthread.h>

#include "ps/wire.h"
#include "ps_test_util.h"

#define DIM 8u

static const char conf[] = "[cluster]\nshards = 1\nworkers = 1\n"
                           "[table f32]\ndim = 8\noptimizer = sgd\nlr = 1\ninit_scale = 0.1\n"
                           "[table f16]\ndim = 8\noptimizer = sgd\nlr = 1\ninit_scale = 0.1\n"
                           "pull_codec = fp16\n";

enum { PASS, NAN_ROW, SHORT };

typedef struct proxy {
    nng_socket front, back;
    pthread_t up, down;
    volatile int mode; /* what to do to the next PULL replies */
    volatile int spoiled;
} proxy;

static void *up_main(void *arg)
{
    proxy *p = arg;
    for (;;) {
        nng_msg *m;
        if (nng_recvmsg(p->front, &m, 0) != 0) return NULL;
        if (nng_sendmsg(p->back, m, 0) != 0) nng_msg_free(m);
    }
}

static void *down_main(void *arg)
{
    proxy *p = arg;
    for (;;) {
        nng_msg *m;
        if (nng_recvmsg(p->back, &m, 0) != 0) return NULL;
        uint8_t *b = nng_msg_body(m);
        size_t len = nng_msg_len(m);
        ps_hdr h;
        if (len >= PS_HDR_BYTES) memcpy(&h, b, sizeof h);
        int mode = p->mode;
        if (len > PS_HDR_BYTES + 4 && h.op == PS_OP_PULL && h.status == 0 && mode != PASS) {
            size_t payload = len - PS_HDR_BYTES;
            if (mode == NAN_ROW) {
                /* The last row's last value: fp32 all ones in the exponent, fp16 likewise. */
                if (h.codec == PS_CODEC_F16) {
                    b[len - 2] = 0x01;
                    b[len - 1] = 0x7e;
                } else {
                    float nan = NAN;
                    memcpy(b + len - 4, &nan, 4);
                }
            } else {
                size_t row = h.codec == PS_CODEC_F16 ? 2u * DIM : 4u * DIM;
                payload -= row;
                nng_msg_chop(m, row);
            }
            ps_wire_seal(nng_msg_body(m), payload);
            p->spoiled++;
        }
        if (nng_sendmsg(p->front, m, 0) != 0) nng_msg_free(m);
    }
}

static void proxy_start(proxy *p, const char *front_url, const char *back_url)
{
    memset(p, 0, sizeof *p);
    if (nng_rep0_open_raw(&p->front) != 0 || nng_req0_open_raw(&p->back) != 0 ||
        nng_listen(p->front, front_url, NULL, 0) != 0 || nng_dial(p->back, back_url, NULL, 0) != 0)
        pt_die("proxy sockets", NULL);
    if (pthread_create(&p->up, NULL, up_main, p) != 0 ||
        pthread_create(&p->down, NULL, down_main, p) != 0)
        pt_die("proxy threads", NULL);
}

static void proxy_stop(proxy *p)
{
    nng_close(p->front);
    nng_close(p->back);
    pthread_join(p->up, NULL);
    pthread_join(p->down, NULL);
}

int main(void)
{
    psp_watchdog(PT_WATCHDOG_S);
    const char *dir = check_tmpdir("ps_hostile");
    ps_config cfg;
    pt_config(dir, "ps.conf", conf, &cfg);
    const char *shard_url = pt_ipc(dir, "s0"), *proxy_url = pt_ipc(dir, "p0");
    ps_server *s0 = pt_server(&cfg, shard_url, 0);
    proxy px;
    proxy_start(&px, proxy_url, shard_url);
    ps_client *direct = pt_client(&cfg, &shard_url, 0, 10000);
    ps_client *c = pt_client(&cfg, &proxy_url, 0, 10000);

    enum { K = 300 };
    uint64_t keys[K];
    for (int i = 0; i < K;
         i++) /* unordered and duplicated: the copying path, not the in-order one */
        keys[i] = 0x9E3779B97F4A7C15ull * (uint64_t)(i % 250 + 1);
    float want[K * DIM], got[K * DIM];
    char *err = NULL;
    for (uint32_t t = 0; t < 2; t++) {
        const char *name = t ? "fp16" : "fp32";
        CHECK_OK(ps_client_pull(direct, t, keys, K, want, &err), err);
        px.mode = PASS;
        CHECK_OK(ps_client_pull(c, t, keys, K, got, &err), err);
        CHECK_MSG(memcmp(want, got, sizeof want) == 0, "%s: rows through the proxy differ", name);

        px.mode = NAN_ROW;
        int before = px.spoiled;
        int rc = ps_client_pull(c, t, keys, K, got, &err);
        CHECK_MSG(px.spoiled > before && rc == CM_ECORRUPT && err && strstr(err, "non-finite"),
                  "%s, a NaN in the reply: rc %d, %s", name, rc, err ? err : "(no message)");
        free(err), err = NULL;

        px.mode = SHORT;
        before = px.spoiled;
        rc = ps_client_pull(c, t, keys, K, got, &err);
        CHECK_MSG(px.spoiled > before && rc == CM_ECORRUPT && err && strstr(err, "bytes"),
                  "%s, a reply one row short: rc %d, %s", name, rc, err ? err : "(no message)");
        free(err), err = NULL;

        /* The client serves the next pull as before. */
        px.mode = PASS;
        CHECK_OK(ps_client_pull(c, t, keys, K, got, &err), err);
        CHECK_MSG(memcmp(want, got, sizeof want) == 0, "%s: rows after the bad replies differ",
                  name);
    }
    ps_client_destroy(c);
    ps_client_destroy(direct);
    proxy_stop(&px);
    ps_server_destroy(s0);
    return pt_finish(dir);
}
