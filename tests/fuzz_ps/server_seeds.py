#!/usr/bin/env python3
"""Writes the seed inputs of tests/fuzz_ps/fuzz_server.c into corpus/server/: valid request
sequences spelled in the target's own input format (a byte for the number of requests, then per
request the header choices, the payload's and the damage byte; see build() and payload() there).
Run it again after changing that format:  python3 tests/fuzz_ps/server_seeds.py"""
import os

HERE = os.path.dirname(os.path.abspath(__file__))
OUT = os.path.join(HERE, "corpus", "server")
DIMS = [4, 8, 3]
DENSE = [8, 4, 5]


def head(op, table=0, codec=0, flags=0, worker=0, clock=0):
    # op, table, codec, flags, worker, request id (0: a fresh one), clock
    return bytes([op, table, codec, flags, worker, 0, clock])


def keys(idx):
    return bytes([len(idx) - 1] + idx)  # pool indexes below 0xe0: this shard's keys


def rows(n, dim):
    return bytes([0]) + bytes((i * 7 + 3) % 64 for i in range(n * dim))  # sane int8/16 values


def pull(table=0, worker=0, flags=0, codec=0, idx=(1, 2, 3)):
    return head(2, table, codec, flags, worker) + bytes([0]) + keys(list(idx)) + bytes([0])


def push(table=0, codec=0, worker=0, idx=(1, 2, 3)):
    idx = list(idx)
    return (head(3, table, codec, 0, worker) + bytes([0]) + keys(idx) +
            rows(len(idx), DIMS[table]) + bytes([0]))


def elided(table=0, codec=0, worker=0, n=3):
    return (head(3, table, codec, 0x02, worker) + bytes([0]) + rows(n, DIMS[table]) +
            bytes([0]))


def dense(op, block=0, flags=0):
    body = bytes([0]) + bytes(range(1, 1 + DENSE[block])) if op in (5, 6) else b""
    return head(op, block, 0, flags) + bytes([0]) + body + bytes([0])


def simple(op, worker=0, clock=0, payload=b""):
    return head(op, worker=worker, clock=clock) + bytes([0]) + payload + bytes([0])


def seq(*reqs):
    return bytes([len(reqs) - 1]) + b"".join(reqs)


SEEDS = {
    "hello": seq(simple(1, payload=bytes([0]))),
    "pull": seq(pull(), pull(table=1, idx=(4, 5)), pull(table=2, flags=0x01)),
    "push_codecs": seq(*(push(table=t, codec=c) for t in range(3) for c in range(2))),
    "push_codecs2": seq(*(push(table=t, codec=c) for t in range(3) for c in range(2, 4))),
    "elided": seq(pull(table=0, idx=(7, 8)), elided(table=0, n=2),
                  pull(table=1, worker=1, codec=3), elided(table=1, codec=3, worker=1)),
    "dense": seq(dense(6, 0), dense(5, 0, 0x04), dense(4, 0), dense(4, 2, 0x08),
                 dense(5, 2, 0x10)),
    "clock_barrier": seq(simple(7, 0, 1), simple(7, 1, 1), simple(8, 0, 1), simple(8, 1, 1)),
    "save_load": seq(push(), simple(9, payload=bytes([1])), simple(10, payload=bytes([1]))),
    # the request inside: its first byte picks among the updates (0 PUSH, 1 PUSH_DENSE)
    "replicate": seq(simple(13, payload=bytes([0]) + push()[1:]),
                     simple(13, payload=bytes([1]) + dense(5, 0)[1:])),
    "stats": seq(simple(11)),
}

os.makedirs(OUT, exist_ok=True)
for name, data in SEEDS.items():
    with open(os.path.join(OUT, name), "wb") as f:
        f.write(data)
