"""Train a two-layer MLP with split einsum on the agents: the Mesh-TensorFlow example, model-parallel.

A 2x2 mesh over 4 agents, ``batch`` split over ``processor_rows`` and ``hidden`` over
``processor_cols`` (Mesh-TensorFlow's layout rules). Every op runs where the shards are:
``c.einsum`` does each device's local einsum and all-reduces a summed dim split over the
mesh (``hidden`` in the logits, ``batch`` in the weight gradients); ``c.apply`` runs the
elementwise kernels, the loss and the SGD update. After every step the loss is checked
against the same model trained in one process with numpy.

    python docs/mlp.py [--steps 20]
"""

import argparse

import numpy as np

import reshard
from reshard import Mesh, Sharding

BATCH, ROWS, COLS, HIDDEN, CLASSES = 64, 8, 8, 32, 10
LR = 0.5


def data(seed: int = 0):
    """Images, one-hot labels from a random teacher, and the initial weights, in float32."""
    rng = np.random.default_rng(seed)
    images = rng.standard_normal((BATCH, ROWS, COLS)).astype(np.float32)
    teacher = rng.standard_normal((ROWS * COLS, CLASSES))
    labels = np.eye(CLASSES, dtype=np.float32)[(images.reshape(BATCH, -1) @ teacher).argmax(1)]
    w1 = (rng.standard_normal((ROWS, COLS, HIDDEN)) / np.sqrt(ROWS * COLS)).astype(np.float32)
    w2 = (rng.standard_normal((HIDDEN, CLASSES)) / np.sqrt(HIDDEN)).astype(np.float32)
    return images, labels, w1, w2


def numpy_losses(steps: int) -> list[float]:
    """The same training in one process: the reference."""
    images, labels, w1, w2 = data()
    losses = []
    for _ in range(steps):
        h_pre = np.einsum("brc,rch->bh", images, w1)
        h = np.maximum(h_pre, 0)
        logits = h @ w2
        shifted = logits - logits.max(1, keepdims=True)
        log_p = shifted - np.log(np.exp(shifted).sum(1, keepdims=True))
        losses.append(float(-(labels * log_p).sum() / BATCH))
        d_logits = (np.exp(log_p) - labels) / BATCH
        d_w2 = np.einsum("bh,bk->hk", h, d_logits)
        d_h = np.einsum("bk,hk->bh", d_logits, w2)
        d_w1 = np.einsum("brc,bh->rch", images, np.where(h_pre > 0, d_h, 0))
        w1, w2 = w1 - LR * d_w1, w2 - LR * d_w2
    return losses


def train(c, steps: int) -> list[float]:
    """The training on the agents; returns the loss after every step."""
    mesh = Mesh.from_hosts({"processor_rows": 2, "processor_cols": 2}, ["host0", "host1", "host2", "host3"], 1)
    images, labels, w1, w2 = data()
    c.put("images", images, Sharding(mesh, ("processor_rows", None, None)))  # batch -> processor_rows
    c.put("labels", labels, Sharding(mesh, ("processor_rows", None)))
    c.put("w1", w1, Sharding(mesh, (None, None, "processor_cols")))  # hidden -> processor_cols
    c.put("w2", w2, Sharding(mesh, ("processor_cols", None)))

    def run(job):
        return job.result(timeout=120)

    losses = []
    for step in range(steps):
        # forward
        run(c.einsum("brc,rch->bh", "images", "w1", out="h_pre"))  # no reduction: rows and cols are whole
        run(c.apply("relu", "h_pre", out="h"))
        run(c.einsum("bh,hk->bk", "h", "w2", out="logits"))  # hidden is split: all-reduce over processor_cols
        run(c.apply("softmax_xent", "logits", "labels", out="row_loss"))
        run(c.apply("sum", "row_loss", out="loss_sum", dims=[0]))  # a scalar, reduced over processor_rows
        # backward
        run(c.apply("softmax_xent_grad", "logits", "labels", out="d_logits", scale=1 / BATCH))
        run(c.einsum("bh,bk->hk", "h", "d_logits", out="d_w2"))  # batch is split: all-reduce over processor_rows
        run(c.einsum("bk,hk->bh", "d_logits", "w2", out="d_h"))
        run(c.apply("relu_grad", "h_pre", "d_h", out="d_h_pre"))
        run(c.einsum("brc,bh->rch", "images", "d_h_pre", out="d_w1"))
        # SGD: each weight gets a new version, in its own layout
        run(c.apply("axpy", "w1", "d_w1", out="w1", alpha=LR))
        run(c.apply("axpy", "w2", "d_w2", out="w2", alpha=LR))
        losses.append(float(c.get("loss_sum")) / BATCH)
        print(f"step {step + 1:2d}  loss {losses[-1]:.6f}")
    return losses


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    steps = parser.parse_args().steps
    with reshard.local_cluster(hosts=4, devices_per_host=1) as c:
        got = train(c, steps)
    want = numpy_losses(steps)
    worst = max(abs(g - w) / abs(w) for g, w in zip(got, want))
    print(f"loss {want[0]:.4f} -> {want[-1]:.4f} in {steps} steps; largest relative difference from numpy {worst:.2e}")
    assert worst <= 1e-5, f"the agents' losses differ from numpy's by {worst:.2e} (relative)"
    assert got[-1] < got[0], "the loss did not fall"
    print("matches numpy")


if __name__ == "__main__":
    main()
