#!/usr/bin/env python3
"""PyTorch side of `tools/bench train` and `tools/bench gpu`: ember's mlp preset, on the CPU
(the default) or, with --device cuda, on a GPU with the embedding table there too.

Reads the binary dump written by tools/bench_train.c (labels, log1p-squashed dense values and
per-field embedding row ids, row 0 = a missing field), trains one epoch in file order with the
same model and optimisers as ember (F x dim + D -> 256 -> 128 -> 1, ReLU, Xavier-uniform
weights, zero biases, embeddings uniform +-0.05, BCE-with-logits, Adagrad on the embeddings,
Adam on the MLP), timing only the training loop, then reports AUC (exact Mann-Whitney, ties
count one half) and logloss (probabilities clipped to [1e-7, 1 - 1e-7]) on the held-out rows.
The last line of stdout is one JSON object.

With --device cuda the rows, the model and both optimisers live on the GPU, and the timed loop
is bracketed by torch.cuda.synchronize() (kernels run asynchronously; without it the clock would
stop before the last batch's work). A table that does not fit the GPU fails with CUDA's
out-of-memory error, which is the point of comparison for ember's PS-held tables.
"""
import argparse
import json
import os
import sys
import time

# torch runs its own pool of --threads intra-op threads and calls BLAS from them; OpenBLAS's
# own pool on the same cores would fight it (measured on 2 cores: 35-45K samples/s with
# OpenBLAS's default of one thread a core, 61-67K with 1). Set before torch loads OpenBLAS;
# the caller's setting wins.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import numpy as np
import torch


def read_dump(path):
    with open(path, "rb") as f:
        head = f.read(40)
    if head[:8] != b"EMBRTB01":
        sys.exit("bench_train.py: %s is not an ember bench dump" % path)
    n_train, n_eval = np.frombuffer(head[8:24], dtype="<u8")
    F, D = np.frombuffer(head[24:32], dtype="<u4")
    V = int(np.frombuffer(head[32:40], dtype="<u8")[0])
    off = 40
    parts = []
    for n in (int(n_train), int(n_eval)):
        y = np.fromfile(path, dtype="<f4", count=n, offset=off)
        off += 4 * n
        x = np.fromfile(path, dtype="<f4", count=n * int(D), offset=off).reshape(n, int(D))
        off += 4 * n * int(D)
        idx = np.fromfile(path, dtype="<i4", count=n * int(F), offset=off).reshape(n, int(F))
        off += 4 * n * int(F)
        parts.append((y, x, idx))
    return parts, int(F), int(D), V


def load_init(path, model, V, dim):
    """Copies ember's initial weights (tools/bench_train.c write_init) into the model."""
    with open(path, "rb") as f:
        buf = f.read()
    if buf[:8] != b"EMBRTI01":
        sys.exit("bench_train.py: %s is not an ember initial-weights file" % path)
    v, = np.frombuffer(buf[8:16], dtype="<u8")
    d, layers = np.frombuffer(buf[16:24], dtype="<u4")
    if int(v) != V or int(d) != dim:
        sys.exit("bench_train.py: %s is for %d rows of dim %d, the dump has %d of %d"
                 % (path, int(v), int(d), V, dim))
    off = 24
    linears = [m for m in model.mlp if isinstance(m, torch.nn.Linear)]
    if int(layers) != len(linears):
        sys.exit("bench_train.py: %s has %d layers, the model %d" % (path, int(layers), len(linears)))
    with torch.no_grad():
        for lin in linears:
            i, o = (int(x) for x in np.frombuffer(buf[off:off + 8], dtype="<u4"))
            off += 8
            if (o, i) != tuple(lin.weight.shape):
                sys.exit("bench_train.py: layer %dx%d in %s, %s in the model" % (o, i, path, tuple(lin.weight.shape)))
            lin.weight.copy_(torch.from_numpy(np.frombuffer(buf, dtype="<f4", count=o * i, offset=off).reshape(o, i).copy()))
            off += 4 * o * i
            lin.bias.copy_(torch.from_numpy(np.frombuffer(buf, dtype="<f4", count=o, offset=off).copy()))
            off += 4 * o
        model.emb.weight.copy_(torch.from_numpy(np.frombuffer(buf, dtype="<f4", count=V * dim, offset=off).reshape(V, dim).copy()))


def auc_exact(scores, labels):
    order = np.argsort(scores, kind="mergesort")
    s = scores[order]
    y = labels[order] > 0.5
    _, inv, counts = np.unique(s, return_inverse=True, return_counts=True)
    ends = np.cumsum(counts)
    avg_rank = ends - (counts - 1) / 2.0  # 1-based average rank of each tie group
    ranks = avg_rank[inv]
    npos = int(y.sum())
    nneg = len(y) - npos
    if npos == 0 or nneg == 0:
        return float("nan")
    return float((ranks[y].sum() - npos * (npos + 1) / 2.0) / (npos * nneg))


class Model(torch.nn.Module):
    def __init__(self, V, F, D, dim, init_scale):
        super().__init__()
        self.F, self.dim = F, dim
        self.emb = torch.nn.Embedding(V, dim, sparse=True, padding_idx=0)
        with torch.no_grad():
            self.emb.weight.uniform_(-init_scale, init_scale)
            self.emb.weight[0].zero_()
        self.mlp = torch.nn.Sequential(
            torch.nn.Linear(F * dim + D, 256), torch.nn.ReLU(),
            torch.nn.Linear(256, 128), torch.nn.ReLU(),
            torch.nn.Linear(128, 1))
        for m in self.mlp:
            if isinstance(m, torch.nn.Linear):
                torch.nn.init.xavier_uniform_(m.weight)
                torch.nn.init.zeros_(m.bias)

    def forward(self, idx, dense):
        e = self.emb(idx).reshape(idx.shape[0], self.F * self.dim)
        return self.mlp(torch.cat([e, dense], dim=1)).squeeze(1)


def train_stale(model, opt_e, opt_d, loss_fn, itr, xtr, ytr, batch):
    """One epoch where batch t+1 is computed with the embedding rows and tower as they were
    before batch t's update (ember's prefetch pulls t+1 before it pushes t)."""
    import copy
    n = len(ytr)
    W = model.emb.weight
    stale_mlp = copy.deepcopy(model.mlp)
    starts = list(range(0, n, batch))
    with torch.no_grad():
        rows_next = W[itr[0:batch]].clone()
    loss_sum = 0.0
    for k, s in enumerate(starts):
        e = min(n, s + batch)
        idx = itr[s:e]
        E = rows_next.requires_grad_(True)
        x = torch.cat([E.reshape(e - s, -1), xtr[s:e]], dim=1)
        logits = stale_mlp(x).squeeze(1)
        loss = loss_fn(logits, ytr[s:e])
        for p in stale_mlp.parameters():
            p.grad = None
        loss.backward()
        with torch.no_grad():
            if k + 1 < len(starts):  # pull t+1 before pushing t
                s2 = starts[k + 1]
                rows_next = W[itr[s2:min(n, s2 + batch)]].clone()
                next_state = [p.detach().clone() for p in model.mlp.parameters()]
            g = E.grad.reshape(-1, E.shape[-1])
            flat = idx.reshape(-1)
            keep = flat != 0
            W.grad = torch.sparse_coo_tensor(flat[keep].unsqueeze(0), g[keep], W.shape)
            for p, sp in zip(model.mlp.parameters(), stale_mlp.parameters()):
                p.grad = sp.grad.clone()
        opt_e.step()
        opt_d.step()
        with torch.no_grad():
            if k + 1 < len(starts):
                for sp, v in zip(stale_mlp.parameters(), next_state):
                    sp.copy_(v)
        loss_sum += float(loss) * (e - s)
    return loss_sum


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--batch", type=int, default=2048)
    ap.add_argument("--dim", type=int, default=16)
    ap.add_argument("--emb-lr", type=float, default=0.05)
    ap.add_argument("--dense-lr", type=float, default=0.001)
    ap.add_argument("--init-scale", type=float, default=0.05)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--device", default="cpu", help="cpu (default) or cuda: where the model, "
                    "its embeddings and the rows live")
    ap.add_argument("--init", help="start from ember's initial weights (tools/bench_train.c write_init)")
    ap.add_argument("--bf16", action="store_true",
                    help="mixed precision: the forward pass under torch.autocast(bfloat16), "
                         "weights and optimisers in fp32 (ember's --bf16 counterpart)")
    ap.add_argument("--stale", action="store_true",
                    help="experiment: emulate ember's pipeline, where batch t+1's rows and tower are "
                         "read before batch t's update (one step stale)")
    a = ap.parse_args()

    torch.set_num_threads(a.threads)
    torch.manual_seed(a.seed)
    dev = torch.device(a.device)
    cuda = dev.type == "cuda"
    if cuda and not torch.cuda.is_available():
        sys.exit("bench_train.py: --device %s but torch sees no CUDA device" % a.device)
    t0 = time.perf_counter()
    (tr, ev), F, D, V = read_dump(a.data)
    ytr, xtr, itr = (torch.from_numpy(tr[0]), torch.from_numpy(tr[1]),
                     torch.from_numpy(tr[2].astype(np.int64)))
    yev, xev, iev = (ev[0], torch.from_numpy(ev[1]), torch.from_numpy(ev[2].astype(np.int64)))
    model = Model(V, F, D, a.dim, a.init_scale)
    if a.init:
        load_init(a.init, model, V, a.dim)
    if cuda:
        # Everything on the GPU before the optimisers see the parameters (their state follows).
        model.to(dev)
        ytr, xtr, itr = ytr.to(dev), xtr.to(dev), itr.to(dev)
        xev, iev = xev.to(dev), iev.to(dev)
        # CUDA's context and cuBLAS's handle are created lazily: not inside the timed loop.
        torch.ones(8, 8, device=dev).matmul(torch.ones(8, 8, device=dev))
        torch.cuda.synchronize()
    opt_e = torch.optim.Adagrad(model.emb.parameters(), lr=a.emb_lr, eps=1e-8,
                                initial_accumulator_value=0.0)
    opt_d = torch.optim.Adam(model.mlp.parameters(), lr=a.dense_lr, betas=(0.9, 0.999), eps=1e-8)
    loss_fn = torch.nn.BCEWithLogitsLoss()
    load_s = time.perf_counter() - t0
    print("pytorch %s: %d train, %d eval rows, %d table rows, %d threads, %s; loaded in %.1f s"
          % (torch.__version__, len(ytr), len(yev), V, torch.get_num_threads(),
             torch.cuda.get_device_name(dev) if cuda else "cpu", load_s),
          file=sys.stderr)

    n = len(ytr)
    loss_sum = 0.0
    model.train()
    if cuda:
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    if a.stale and a.bf16:
        sys.exit("bench_train.py: --stale and --bf16 do not combine")
    if a.stale:
        loss_sum = train_stale(model, opt_e, opt_d, loss_fn, itr, xtr, ytr, a.batch)
    for s in range(0, 0 if a.stale else n, a.batch):
        e = min(n, s + a.batch)
        if a.bf16:
            with torch.autocast(dev.type, dtype=torch.bfloat16):
                logits = model(itr[s:e], xtr[s:e])
            logits = logits.float()
        else:
            logits = model(itr[s:e], xtr[s:e])
        loss = loss_fn(logits, ytr[s:e])
        opt_e.zero_grad(set_to_none=True)
        opt_d.zero_grad(set_to_none=True)
        loss.backward()
        opt_e.step()
        opt_d.step()
        # float() would wait for the GPU every batch; on cuda the sum stays there until the end.
        loss_sum += loss.detach().double() * (e - s) if cuda else float(loss) * (e - s)
    if cuda:
        torch.cuda.synchronize()
    train_s = time.perf_counter() - t0
    loss_sum = float(loss_sum)

    model.eval()
    probs = []
    with torch.no_grad():
        for s in range(0, len(yev), 65536):
            probs.append(torch.sigmoid(model(iev[s:s + 65536], xev[s:s + 65536])).cpu().numpy())
    p = np.concatenate(probs).astype(np.float64)
    auc = auc_exact(p.astype(np.float32), yev)
    pc = np.clip(p, 1e-7, 1 - 1e-7)
    logloss = float(-np.mean(yev * np.log(pc) + (1 - yev) * np.log(1 - pc)))
    print(json.dumps({"torch": torch.__version__, "threads": torch.get_num_threads(),
                      "rows": n, "eval_rows": len(yev), "seconds": round(train_s, 3),
                      "samples_per_s": round(n / train_s, 1), "train_loss": loss_sum / n,
                      "auc": auc, "logloss": logloss, "load_seconds": round(load_s, 3),
                      "stale": a.stale, "bf16": a.bf16, "device": a.device,
                      "openblas_threads": os.environ.get("OPENBLAS_NUM_THREADS")},
                     separators=(",", ":")))


if __name__ == "__main__":
    main()
