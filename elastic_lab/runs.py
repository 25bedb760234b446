"""elastic_lab/runs.py — the machinery around train_router.py's experiment, kept out of its way: the
run folder and its lock, the stop signals, several processes (torchrun), and the CUDA-graph replay
of a training step. Nothing here changes what a run computes."""
import os
import signal

try:
    import fcntl   # the run folder's lock; Windows has none, and runs unlocked
except ImportError:
    fcntl = None

import torch
import torch.distributed as dist

from elastic_attention import HEAD_CONFIGS, kernels, masks


def fail(message):
    """End the run with one line (no traceback): bad input, or what to do after a stop."""
    raise SystemExit(f"error: {message}")

# -----------------------------------------------------------------------------
# The run folder, and the signals that stop a run.


RUN_FILES = ("results.json", "model.pt", "router.pt", "static.pt", "backbone.pt")


def make_out_dir(args, rank):
    """(run name, output folder, lock). The folder belongs to one run: files of another run there are
    refused, unless --resume continues that run or --overwrite replaces it, and a lock held while this
    run lives keeps a second run out (the OS drops it if the process dies, kill -9 included)."""
    run_name = f"{'smoke' if args.smoke else args.preset}-{args.config}-seed{args.seed}"
    out_dir = args.out or os.path.join("runs", run_name)
    if os.path.exists(out_dir) and not os.path.isdir(out_dir):
        fail(f"--out {out_dir!r} is a file, not a folder")
    try:
        os.makedirs(out_dir, exist_ok=True)
    except OSError as e:
        fail(f"cannot create the output folder {out_dir!r}: {e.strerror}")
    if rank:
        return run_name, out_dir, None
    try:
        lock = open(os.path.join(out_dir, ".lock"), "w")
    except OSError as e:
        fail(f"cannot write into the output folder {out_dir!r}: {e.strerror}")
    if fcntl is not None:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            fail(f"another run is writing into {out_dir!r}: wait for it, or choose another --out")
    found = [f for f in RUN_FILES if os.path.exists(os.path.join(out_dir, f))]
    resuming = args.resume and os.path.dirname(os.path.abspath(args.resume)) == os.path.abspath(out_dir)
    if found and not resuming:
        if not args.overwrite:
            fail(f"--out {out_dir!r} holds another run's {', '.join(found)}, which this run would replace: "
                 f"continue that run with --resume {os.path.join(out_dir, 'router.pt')}, replace it with "
                 f"--overwrite, or choose another --out")
        for f in found:   # no mix of the old run's files and the new one's
            os.remove(os.path.join(out_dir, f))
    return run_name, out_dir, lock


def stopped(out_dir):
    """The handler of Ctrl-C and SIGTERM outside the training loops (which save first): one line
    naming what continues the run."""
    def handler(signum, frame):
        path = os.path.join(out_dir, "router.pt")
        fail(f"interrupted ({signal.Signals(signum).name}): " + (f"continue with --resume {path}" if os.path.exists(path)
                                                                else "nothing saved yet; run the command again"))
    return handler


# -----------------------------------------------------------------------------
# Several processes (torchrun): each draws the same global batch and keeps its shard.


def init_distributed(P):
    """(rank, world): under torchrun every rank draws the same global batch and keeps its shard."""
    if not ("RANK" in os.environ and "WORLD_SIZE" in os.environ):
        return 0, 1
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if P["device"].startswith("cuda"):
        P["device"] = f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}"
        torch.cuda.set_device(P["device"])
    dist.init_process_group("nccl" if P["device"].startswith("cuda") else "gloo")
    if P["batch_size"] % world:
        fail(f"--batch-size {P['batch_size']} must be a multiple of the {world} processes")
    return rank, world


def sum_over_processes(params):
    """Replace each .grad by its sum over the processes, in one all-reduce (not inside a CUDA graph:
    the replay has written the gradients by then)."""
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    flat = torch.cat([g.flatten() for g in grads])
    dist.all_reduce(flat)
    for p, g, total in zip(params, grads, flat.split([g.numel() for g in grads])):
        p.grad = g.copy_(total.view_as(g))   # in place: a recording's replay writes into these tensors


def from_rank0(*modules):
    """Every process takes rank 0's parameters and buffers of these modules, in place."""
    for module in modules:
        for t in module.state_dict().values():
            dist.broadcast(t, 0)


def same_on_every_rank(run, value):
    """With several processes: whether every one holds this value (a weights' sha256, say)."""
    values = [None] * run.world
    dist.all_gather_object(values, value)
    return len(set(values)) == 1


def replica_difference(run, params):
    """With several processes: the largest difference of the trained parameters between them (equal
    starts, summed gradients and the same optimiser keep them equal)."""
    flat = torch.cat([p.detach().flatten().cpu() for p in params])
    replicas = [None] * run.world
    dist.all_gather_object(replicas, flat)
    return max((r - replicas[0]).abs().max().item() for r in replicas)

# -----------------------------------------------------------------------------
# One training step replayed as a CUDA graph.


def replays_as_graph(run, model):
    """Whether the training steps replay as a CUDA graph (StepGraph): on a GPU (with several processes,
    each replays its own; the gradients are summed after the replay), with the hard-concrete gate
    (the Gumbel gate's temperature changes every step), and with attention in the fused kernel,
    which needs no host sync (the torch backend asks whether the heads share a mode). Head
    configurations with XAttention heads run op by op: their recording is untested."""
    cfg = model.cfg
    if run.device.type != "cuda" or not run.P["cuda_graph"] or cfg.gate != "hard-concrete":
        return False
    probe = torch.empty(1, 1, 1, cfg.head_dim, dtype=next(model.parameters()).dtype, device=run.device)
    fused = kernels.prefill_backend(cfg.backend, probe) == "triton"
    return fused and masks.BLOCK_SPARSE not in HEAD_CONFIGS[cfg.head_config]


class StepGraph:
    """A training step's forward, loss and backward recorded once as a CUDA graph, then replayed.
    The frozen model's step is thousands of small kernels (SmolLM2: ~6500), and launching them one by
    one from Python took longer than running them; a replay launches them all at once. Each step's
    batch is copied into the recording's own input tensors; its outputs, and the parameters' .grad,
    are the same tensors at every replay (.grad is never set to None between steps). A batch of
    another shape (with fewer samples than tasks, another answer length) gets a recording of its own. A
    recording cannot hold a host sync, so it runs fn(inputs, check=False); the eager warm-up run before
    it, fn(inputs), checks the inputs and compiles the kernels."""

    def __init__(self, params):
        self.params, self.recordings = list(params), {}

    def __call__(self, fn, inputs):
        """fn(inputs), inputs a dict of device tensors, replayed from the recording for their shapes
        (recorded as fn(inputs, check=False))."""
        shapes = tuple((k, tuple(v.shape), v.dtype) for k, v in inputs.items())
        if shapes not in self.recordings:
            self.recordings[shapes] = self.record(fn, inputs)
        graph, static_inputs, outputs, grads = self.recordings[shapes]
        for k, v in inputs.items():
            static_inputs[k].copy_(v)
        for p, g in zip(self.params, grads):
            p.grad = g   # this recording's gradient tensors, which its replay writes
        graph.replay()
        return outputs

    def record(self, fn, inputs):
        static_inputs = {k: v.clone() for k, v in inputs.items()}
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        for p in self.params:
            p.grad = None
        with torch.cuda.stream(side):   # the warm-up run of torch.cuda.graph's recipe, with the value checks
            fn(static_inputs)
        torch.cuda.current_stream().wait_stream(side)
        for p in self.params:
            p.grad = None   # the recorded backward then allocates .grad itself
        torch.cuda.empty_cache()   # the warm-up's cached blocks are not the recording's: give them back
        graph = torch.cuda.CUDAGraph()
        # thread_local: the data loader's pin-memory thread may allocate while this thread records
        with torch.cuda.graph(graph, stream=side, capture_error_mode="thread_local"):
            outputs = fn(static_inputs, check=False)
        return graph, static_inputs, outputs, [p.grad for p in self.params]
