"""The routing of a mixture-of-experts policy during RL: what the recompute chose, replaying it in
the updates (R2), and the router's metrics.

Each forward of a micro-batch runs every router of this pipeline stage once; a forward hook on
each router reads its routing map [tokens, experts] (tokens in Megatron's [S, B] order).

* The recompute records, for every sample, the top-k experts of each of its tokens in each local
  MoE layer (``Sample.routing``: [layers, length, k], sorted).
* With replay (``rollout.routing_replay: recompute``, R2) every update forward hands each router
  the recorded experts through Megatron-Core's ``RouterReplay`` (REPLAY_FORWARD): the update's
  probs are the current router's scores at those experts, so gradients still reach the router.
  With activation recompute the backward's re-forward replays them too (REPLAY_BACKWARD: each
  router pops the targets in the order the forwards set them, which every schedule keeps).
* ``rollout``: R3. The recompute replays the rollout engine's routing (``Sample.engine_routing``,
  every token of every MoE layer, inprocess.py records it), so the recorded routing, and every
  update's, is the engine's. Whatever the mode, where the engine's routing is known the recompute
  counts how much of its own differs from it: ``moe/rollout_routing_mismatch``.
* Each update forward compares its routing with the recorded one: ``moe/routing_mismatch`` is the
  fraction of (token, layer) pairs whose expert sets differ (0 by construction with replay).
* Expert parallelism pairs the forwards (and backward re-forwards) of the EP ranks (each MoE
  layer's all-to-all), so every rank of the EP group runs as many micro-batches as the others:
  the ranks that packed fewer get filler micro-batches (``with_fillers``), one row of padding
  whose loss is 0 x its output: no gradient, no metric, no routing record. In an update its
  routers run in eval mode, so no router loss is attached, in the forward and in the backward's
  re-forward alike (re-forwards come in the order of the forwards, as for REPLAY_BACKWARD).
  The CP ranks of a DP replica run the same micro-batches, so they run their fillers together.
* Rows: a padded row holds one sample, a packed row several back to back (``cu_seqlens_padded``
  says where each starts). Under context parallelism a rank's forward sees its chunks of every
  row (``MicroBatch.cp_columns``, trainer/context_parallel.py): the recompute all-gathers the
  CP ranks' routing to record each sample whole (every CP rank holds the same records), and an
  update replays the columns of the record its rank holds.
* Expert load: tokens routed to each expert over the step's update forwards (real tokens, summed
  over DP x CP), per layer; the router's losses as Megatron's tracker holds them.
* The router losses (load balancing, z-loss) count real tokens only: each micro-batch hands its
  padding (``MicroBatch.padding``: a padded row's right end, CP's and TP's divisibility padding
  of a row or of a packed sequence) to Megatron's ``padding_mask``, which leaves it out of the
  losses and of their token counts (routing and replay are unchanged: padding is routed, its
  routing recorded nowhere and replayed as the first k experts, and no real token sees it).
* Their gradient scale: Megatron attaches a micro-batch's router losses as they are (each
  router's ``calculate_per_token_loss`` is off, whatever the model's config says) and
  multiplies their gradient by the scale ``MoEAuxLossAutoScaler`` holds during the backward.
  The losses of this trainer arrive normalised by the step, so each micro-batch's weight is
  its real tokens (the whole micro-batch's, over CP) over the step's (over DP x CP),
  set as the backward of that micro-batch's output begins (``weigh``: per micro-batch in any
  pipeline order): the router losses enter the step as their token-weighted mean over
  micro-batches and DP ranks, times their coefficients, however the tokens are cut into
  micro-batches. Under context parallelism each CP rank's load-balancing loss is its tokens'
  share of the micro-batch's (the shares add up to it exactly); Megatron's z-loss there is
  the mean of each CP rank's real tokens over CP, the micro-batch's mean where the CP ranks
  hold as many real tokens (CP's padding can make them differ by a few), and its tracked value
  the sum of the CP ranks' (so the metric divides by CP).
"""

from __future__ import annotations

import collections
import contextlib
import functools
from typing import Iterator, Optional, Sequence

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps
from megatron.core.transformer.moe import moe_utils
from megatron.core.transformer.moe.router import MoEAuxLossAutoScaler, TopKRouter
from megatron.core.transformer.moe.router_replay import RouterReplayAction

from megatron_entropy.models.sharding import unwrap_model
from megatron_entropy.trainer.batch import MicroBatch, Sample
from megatron_entropy.trainer.step_metrics import device

REPLAY_MODES = ("none", "recompute", "rollout")
# Megatron's tracker names -> metric keys.
_TRACKED_LOSSES = {"load_balancing_loss": "moe/aux_loss", "z_loss": "moe/z_loss"}

# Measured on vLLM 0.32.0's CPU build (docs/moe.md, tests/servers/test_moe_servers.py).
VLLM_MOE_RELOAD = (
    "rollout.engine=vllm with a mixture-of-experts model: vLLM 0.32's CPU build reloads MoE "
    "weights wrongly (after a weight sync it scores 1.95e-2 nats per token off the synced "
    "weights in fp32, rollouts drift 1.1e-2 to 2.8e-2 nats from the actor, and the weight check "
    "passes; GPU builds not measured): watch rollout/logprob_drift, or use rollout.engine="
    "inprocess (which can also replay its routing, routing_replay=rollout) or sglang")


def with_fillers(micro_batches: list[MicroBatch]) -> list[MicroBatch]:
    """``micro_batches`` and as many fillers as the EP group's largest count needs (none
    without expert parallelism); a filler has no samples (``is_filler``)."""
    if ps.get_expert_model_parallel_world_size() == 1:
        return micro_batches
    count = torch.tensor([len(micro_batches)], dtype=torch.long, device=device())
    dist.all_reduce(count, op=dist.ReduceOp.MAX, group=ps.get_expert_model_parallel_group())
    # Sequence parallelism splits the sequence over TP: one token per TP rank, and under context
    # parallelism a token for each of the rank's two chunks.
    length = ps.get_tensor_model_parallel_world_size() * (
        2 if ps.get_context_parallel_world_size() > 1 else 1)
    empty = torch.zeros(0, dtype=torch.long)
    fillers = [MicroBatch(tokens=torch.zeros(1, length, dtype=torch.long),
                          position_ids=torch.arange(length).view(1, length),
                          flat_positions=empty, targets=empty, rows=empty, cols=empty,
                          mask=torch.zeros(1, 1), advantages=torch.zeros(1, 1), sample_ids=[],
                          index=len(micro_batches) + i)
               for i in range(int(count) - len(micro_batches))]
    return micro_batches + fillers


def is_filler(mb: MicroBatch) -> bool:
    return not mb.sample_ids


def router_padding(model, mb: MicroBatch) -> Optional[torch.Tensor]:
    """``mb.padding`` as Megatron's ``padding_mask`` takes it at this model chunk: [rows, S],
    True on padding. Megatron splits it over TP for sequence parallelism on the first pipeline
    stage only; a later stage's hidden states are the TP rank's part of the sequence too, so
    there it gets that part of the mask."""
    if mb.padding is None:
        return None
    module = unwrap_model(model)
    if not module.config.sequence_parallel or module.pre_process:
        return mb.padding
    tp, rank = (ps.get_tensor_model_parallel_world_size(),
                ps.get_tensor_model_parallel_rank())
    part = mb.padding.shape[1] // tp
    return mb.padding[:, rank * part:(rank + 1) * part]


def real_tokens(mb: MicroBatch) -> int:
    """The tokens of ``mb`` that are no padding (all of them where it says of none)."""
    return mb.tokens.numel() if mb.padding is None else int((~mb.padding).sum())


def engine_notes(engine: str, arch) -> list[str]:
    """Start-up warnings for an MoE policy on an engine with a known MoE problem (a warning, not
    a refusal: the drift was measured on the CPU build only, and rollout correction can bound
    it)."""
    return [VLLM_MOE_RELOAD] if engine == "vllm" and arch.is_moe else []


class MoeRouting:
    """Routing records, replay and metrics of one MoE model (the trainable policy)."""

    def __init__(self, model_chunks, replay: str = "none") -> None:
        if replay not in REPLAY_MODES:
            raise ValueError(f"routing replay {replay!r} is not one of {', '.join(REPLAY_MODES)}")
        module = unwrap_model(model_chunks)
        self.routers = [m for m in module.modules() if isinstance(m, TopKRouter)]
        if replay != "none" and any(r.router_replay is None for r in self.routers):
            raise ValueError("routing replay needs a model built with it (MoeOptions."
                             "routing_replay)")
        self.mode = replay
        self.replay = replay != "none"  # the updates replay the recorded routing
        # Full activation recompute re-runs each layer's forward in the backward.
        self.recompute = module.config.recompute_granularity == "full"
        self.backward_replay = self.replay and self.recompute
        self.topk = module.config.moe_router_topk
        self.num_experts = module.config.num_moe_experts
        self.layer_numbers = [r.layer_number for r in self.routers]  # global, from 1
        self.num_layers = module.config.num_layers
        # The router losses this model adds (Megatron tracks each one it applies).
        self.losses = [n for n, on in (("load_balancing_loss", module.config.moe_aux_loss_coeff),
                                       ("z_loss", module.config.moe_z_loss_coeff)) if on]
        self._maps: Optional[list[torch.Tensor]] = None
        # Inside an update schedule: each micro-batch's router-loss weight (by index) and
        # Megatron's scale for them (aux_loss_scale).
        self._weights: dict[int, float] = {}
        self._base_scale = torch.ones(())
        self._set_scale = MoEAuxLossAutoScaler.set_loss_scale
        # Inside an update forward: whether it is a filler's; per router, that of each forward
        # whose re-forward is still to come (activation recompute).
        self._filler: Optional[bool] = None
        self._reforwards: list[collections.deque] = [collections.deque() for _ in self.routers]
        for i, router in enumerate(self.routers):
            router.calculate_per_token_loss = False  # weighted by ``weigh`` instead
            router.register_forward_pre_hook(functools.partial(self._before, i))
            router.register_forward_hook(self._capture)
        self._reset()

    def _reset(self) -> None:
        self.load = torch.zeros(len(self.routers), self.num_experts, dtype=torch.float64)
        self.mismatch = torch.zeros(2, dtype=torch.float64)  # differing pairs, compared pairs
        self.rollout_mismatch = torch.zeros(2, dtype=torch.float64)  # recompute vs the engine
        self.forwards = 0

    def _capture(self, module, args, output) -> None:
        if self._maps is not None:
            self._maps.append(output[1].detach())
        if getattr(module, "_filler_eval", False):
            module._filler_eval = False
            module.training = True

    def _before(self, i: int, module, args) -> None:
        """A filler's router runs in eval mode: in its update forward, and in the backward's
        re-forward (a training-mode forward with gradients outside any update forward)."""
        if not module.training:
            return
        if self._filler is not None:
            filler = self._filler
            if self.recompute:
                self._reforwards[i].append(filler)
        elif self.recompute and torch.is_grad_enabled() and self._reforwards[i]:
            filler = self._reforwards[i].popleft()
        else:
            return
        if filler:
            module._filler_eval = True
            module.training = False

    def _top_experts(self, routing_map: torch.Tensor) -> torch.Tensor:
        """[tokens, k] sorted expert ids of a routing map without dropped tokens."""
        return routing_map.nonzero()[:, 1].view(routing_map.shape[0], self.topk)

    @contextlib.contextmanager
    def _forward(self) -> Iterator[list[torch.Tensor]]:
        self._maps = []
        try:
            yield self._maps
        finally:
            self._maps = None

    def _layout(self, mb: MicroBatch, samples: Sequence[Sample]
                ) -> tuple[int, int, list[tuple[int, int, int]], torch.Tensor]:
        """S, B of the whole rows (under context parallelism: all CP ranks' columns), where
        each sample lies in them, (row, first column, length), and the [S, B] mask of real
        tokens: a padded row is one sample, a packed row several back to back."""
        B = mb.tokens.shape[0]
        S = mb.tokens.shape[1] * (1 if mb.cp_columns is None
                                  else ps.get_context_parallel_world_size())
        starts = ([0] * B if mb.cu_seqlens_padded is None
                  else mb.cu_seqlens_padded[:-1].tolist())
        rows = range(B) if mb.cu_seqlens_padded is None else [0] * len(mb.sample_ids)
        spans = [(b, int(start), samples[sid].length)
                 for b, start, sid in zip(rows, starts, mb.sample_ids)]
        real = torch.zeros(S, B, dtype=torch.bool)
        for b, start, n in spans:
            real[start:start + n, b] = True
        return S, B, spans, real

    @staticmethod
    def _local(mb: MicroBatch, whole: torch.Tensor, dim: int) -> torch.Tensor:
        """This CP rank's columns (dim ``dim``) of a tensor over the whole rows."""
        if mb.cp_columns is None:
            return whole
        return whole.index_select(dim, mb.cp_columns.cpu())

    def _targets(self, routings: Sequence[torch.Tensor], spans: Sequence[tuple[int, int, int]],
                 S: int, B: int) -> torch.Tensor:
        """[layers, S, B, k] the samples' recorded experts; padding positions route to the
        first k experts (no real token attends to them: right padding, or a packed sequence's
        own end)."""
        target = torch.arange(self.topk).expand(len(self.routers), S, B, self.topk).clone()
        for r, (b, start, n) in zip(routings, spans):
            target[:, start:start + n, b] = r.long()
        return target

    def _whole_rows(self, mb: MicroBatch, local: torch.Tensor, S: int) -> torch.Tensor:
        """[layers, S / CP, B, k] of this CP rank's columns -> [layers, S, B, k] of the whole
        rows, from every CP rank (one all-gather of each; as it is without CP)."""
        if mb.cp_columns is None:
            return local
        group = ps.get_context_parallel_group()
        cp = dist.get_world_size(group)
        parts = [torch.empty_like(local) for _ in range(cp)]
        columns = [torch.empty_like(mb.cp_columns) for _ in range(cp)]
        dist.all_gather(parts, local.contiguous(), group=group)
        dist.all_gather(columns, mb.cp_columns, group=group)
        whole = local.new_zeros(local.shape[0], S, *local.shape[2:])
        for part, cols in zip(parts, columns):
            whole[:, cols] = part
        return whole

    def _engine_routing(self, sample: Sample) -> Optional[torch.Tensor]:
        """This stage's layers of the engine's routing of ``sample``, [layers, length, k]."""
        r = sample.engine_routing
        if r is None:
            return None
        if tuple(r.shape) != (self.num_layers, sample.length, self.topk):
            raise ValueError(f"the engine's routing of a sample has shape {tuple(r.shape)}, "
                             f"not [MoE layers, tokens, k] = [{self.num_layers}, "
                             f"{sample.length}, {self.topk}]")
        return r[[n - 1 for n in self.layer_numbers]]

    def _start_replay(self, target: torch.Tensor) -> None:
        layers, S, B, k = target.shape
        for router, t in zip(self.routers, target):
            router.router_replay.set_target_indices(t.reshape(S * B, k).to(router.weight.device))
            router.router_replay.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)

    def _stop_replay(self, backward: bool) -> None:
        """After a replayed forward: ``backward``: its targets wait for the backward's
        re-forward; else they are dropped."""
        for router in self.routers:
            if backward:
                router.router_replay.set_router_replay_action(RouterReplayAction.REPLAY_BACKWARD)
            else:
                router.router_replay.clear_router_replay_action()
                router.router_replay.clear_indices()

    def _mismatch(self, maps: Sequence[torch.Tensor], target: torch.Tensor,
                  real: torch.Tensor) -> torch.Tensor:
        """[differing, compared] (token, layer) pairs of a forward's routing against ``target``
        over the real tokens."""
        S, B = real.shape
        out = torch.zeros(2, dtype=torch.float64)
        for layer, m in enumerate(maps):
            got = self._top_experts(m).cpu().view(S, B, self.topk)
            differs = (got != target[layer]).any(-1)
            out += torch.tensor([float(differs[real].sum()), float(real.sum())],
                                dtype=torch.float64)
        return out

    @contextlib.contextmanager
    def record(self, mb: MicroBatch, samples: Sequence[Sample]) -> Iterator[None]:
        """Around the recompute's forward of ``mb``: each sample's routing is stored (with R3
        the engine's, replayed) and compared with the engine's where every row has it."""
        S, B, spans, real = self._layout(mb, samples)
        engine = [self._engine_routing(samples[sid]) for sid in mb.sample_ids]
        known = all(e is not None for e in engine)
        if self.mode == "rollout" and not known:
            raise RuntimeError("rollout.routing_replay=rollout needs the engine's routing of "
                               "every sample (the in-process engine returns it for MoE models)")
        target = self._local(mb, self._targets(engine, spans, S, B), 1) if known else None
        if self.mode == "rollout":
            self._start_replay(target)
        try:
            with self._forward() as maps:
                yield
        finally:
            if self.mode == "rollout":
                self._stop_replay(backward=False)
        local = torch.stack([self._top_experts(m).view(-1, B, self.topk) for m in maps])
        whole = self._whole_rows(mb, local, S).to(torch.int16).cpu()
        for sid, (b, start, n) in zip(mb.sample_ids, spans):
            samples[sid].routing = whole[:, start:start + n, b].clone()
        if known:
            self.rollout_mismatch += self._mismatch(maps, target, self._local(mb, real, 0))

    @contextlib.contextmanager
    def update(self, mb: MicroBatch, samples: Sequence[Sample]) -> Iterator[None]:
        """Around an update forward of ``mb``: replay the recorded routing (if on), then count
        the mismatch against it and the expert load."""
        recorded = [samples[sid].routing for sid in mb.sample_ids]
        if any(r is None for r in recorded):
            raise RuntimeError("an MoE update needs the recompute's routing of every sample "
                               "(Actor.recompute records it)")
        S, B, spans, real = self._layout(mb, samples)
        target = self._local(mb, self._targets(recorded, spans, S, B), 1)
        real = self._local(mb, real, 0)
        if self.replay:
            self._start_replay(target)
        self._filler = False
        try:
            with self._forward() as maps:
                yield
        finally:
            self._filler = None
            if self.replay:
                self._stop_replay(backward=self.backward_replay)
        self.forwards += 1
        self.mismatch += self._mismatch(maps, target, real)
        flat_real = real.reshape(-1)
        for layer, m in enumerate(maps):
            self.load[layer] += m.cpu()[flat_real].sum(0).double()

    @contextlib.contextmanager
    def filler(self, mb: MicroBatch) -> Iterator[None]:
        """Around a filler's update forward: routers in eval mode; with replay, it routes to the
        first k experts like padding (and its re-forward takes that routing in turn)."""
        S, B = mb.tokens.shape[1], mb.tokens.shape[0]
        if self.replay:
            self._start_replay(self._targets([], [], S, B))
        self._filler = True
        try:
            yield
        finally:
            self._filler = None
            if self.replay:
                self._stop_replay(backward=self.backward_replay)

    @contextlib.contextmanager
    def schedule(self, micro_batches: Sequence[MicroBatch]) -> Iterator[None]:
        """Around one optimizer step's schedule: the aux-loss scale; with backward replay, every
        re-forward has taken its targets at the end."""
        try:
            with self.aux_loss_scale(micro_batches):
                yield
            if self.backward_replay and any(r.router_replay.replay_backward_list
                                            for r in self.routers) or any(self._reforwards):
                raise RuntimeError("MoE routing: a backward re-forward did not take its "
                                   "routing (activation recompute)")
        finally:
            if self.backward_replay:
                self._stop_replay(backward=False)
            for pending in self._reforwards:
                pending.clear()

    @contextlib.contextmanager
    def aux_loss_scale(self, micro_batches: Sequence[MicroBatch]) -> Iterator[None]:
        """For one optimizer step's schedule: the router losses' gradient scale (module
        docstring): each micro-batch's weight, its real tokens (over CP) over the step's (over
        DP x CP), times the scale Megatron sets (the mixed-precision loss scale)."""
        real = [mb for mb in micro_batches if not is_filler(mb)]
        local = torch.tensor([float(real_tokens(mb)) for mb in real], dtype=torch.float64)
        total = local.sum().reshape(1)
        dist.all_reduce(total, group=ps.get_data_parallel_group(with_context_parallel=True))
        if ps.get_context_parallel_world_size() > 1:
            dist.all_reduce(local, group=ps.get_context_parallel_group())
        divisor = max(float(total), 1.0)
        self._weights = {mb.index: float(n) / divisor for mb, n in zip(real, local)}
        original = self._set_scale = MoEAuxLossAutoScaler.set_loss_scale

        def remember(scale: torch.Tensor) -> None:  # Megatron's, at each forward
            self._base_scale = scale

        MoEAuxLossAutoScaler.set_loss_scale = staticmethod(remember)
        try:
            yield
        finally:
            MoEAuxLossAutoScaler.set_loss_scale = staticmethod(original)
            self._weights = {}

    def weigh(self, output: torch.Tensor, mb: MicroBatch) -> None:
        """On an update forward's output: its backward, which reaches the routers' losses
        after it, first sets their gradient scale to the micro-batch's weight (per micro-batch,
        whatever order the pipeline schedule runs the backwards in)."""
        weight = self._weights.get(mb.index)
        if weight is None or not output.requires_grad:
            return

        def set_scale(grad: torch.Tensor) -> None:
            self._set_scale(self._base_scale * weight)

        output.register_hook(set_scale)

    def metrics(self) -> dict[str, float]:
        """The step's routing metrics on every rank: pairs, losses and loads summed over DP x CP
        (a CP rank counts its own tokens, and its router losses are its tokens' share of the
        micro-batch's, which Megatron's tracker holds unreduced) and then over the PP stages
        (each holds its own layers); resets the counts and Megatron's loss tracker."""
        dp, pp = (ps.get_data_parallel_group(with_context_parallel=True),
                  ps.get_pipeline_model_parallel_group())
        tracker = moe_utils.get_moe_layer_wise_logging_tracker()
        losses = [tracker[n]["values"].detach().double().sum().cpu() if n in tracker
                  else torch.zeros((), dtype=torch.float64) for n in self.losses]
        per_dp = torch.stack([*self.mismatch, *self.rollout_mismatch,
                              torch.tensor(float(self.forwards), dtype=torch.float64), *losses])
        load = torch.zeros(self.num_layers, self.num_experts, dtype=torch.float64)
        for i, n in enumerate(self.layer_numbers):
            load[n - 1] = self.load[i]
        dist.all_reduce(per_dp, group=dp)
        dist.all_reduce(load, group=dp)
        # the same on every stage; every CP rank ran each forward
        forwards = float(per_dp[4]) / ps.get_context_parallel_world_size()
        per_pp = torch.cat([per_dp[:4], per_dp[5:], torch.tensor(
            [float(len(self.routers))], dtype=torch.float64)])
        dist.all_reduce(per_pp, group=pp)
        dist.all_reduce(load, group=pp)
        moe_utils.clear_aux_losses_tracker()
        self._reset()
        differ, pairs, layers = float(per_pp[0]), float(per_pp[1]), float(per_pp[-1])
        out: dict[str, float] = {}
        if pairs:
            out["moe/routing_mismatch"] = differ / pairs
        if float(per_pp[3]):
            out["moe/rollout_routing_mismatch"] = float(per_pp[2]) / float(per_pp[3])
        for name, total in zip(self.losses, per_pp[4:-1]):
            if forwards:
                # a CP rank's z-loss is its own tokens' mean (module docstring)
                ranks = ps.get_context_parallel_world_size() if name == "z_loss" else 1
                out[_TRACKED_LOSSES[name]] = float(total) / (forwards * layers * ranks)
        imbalance = 0.0
        for n, row in enumerate(load):
            if row.sum() > 0:
                mean = float(row.mean())
                out[f"moe/layer{n}/tokens_per_expert_max"] = float(row.max())
                out[f"moe/layer{n}/tokens_per_expert_mean"] = mean
                imbalance = max(imbalance, float(row.max()) / mean)
        if imbalance:
            out["moe/load_imbalance"] = imbalance
        return out
