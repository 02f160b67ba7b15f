"""Tree speculative decoding: tree construction, verification, cache compaction, losslessness, baselines."""
import math

import pytest
import torch

from models.decoding import (CallableProposer, DraftTree, OracleProposer, TreeSpec, accept, ancestor_mask,
                             chain_length, chain_tree, compact_cache, draft_tree, exact_match, first_divergence,
                             greedy_generate, lm_log_probs, lossless_at_near_tie, prefill, prompt_lookup_generate,
                             speculative_generate, verify)
from models.target import tiny_target

V = 11


def path_logp(path: tuple[int, ...]) -> torch.Tensor:
    """A fixed random draft distribution per token path (hand-made drafter)."""
    g = torch.Generator().manual_seed(hash(path) % (2 ** 31))
    return torch.log_softmax(torch.randn(V, generator=g) * 2, -1)


def naive_eagle2(root: int, spec: TreeSpec) -> dict[tuple[int, ...], float]:
    """Reference EAGLE-2 expansion over explicit paths: every candidate path -> cumulative log-prob."""
    k = spec.top_k
    lp = path_logp((root,))
    top = lp.topk(k)
    level = {(root, int(t)): float(s) for t, s in zip(top.indices, top.values)}
    cands = dict(level)
    frontier = sorted(level, key=level.get, reverse=True)[:k]
    for _ in range(spec.depth):
        new = {}
        for p in frontier:
            c = path_logp(p).topk(k)
            for t, s in zip(c.indices, c.values):
                new[p + (int(t),)] = cands[p] + float(s)
        cands.update(new)
        frontier = sorted(new, key=new.get, reverse=True)[:k]
    return cands


def tree_paths(tree: DraftTree) -> list[tuple[int, ...]]:
    toks, par = tree.tokens.tolist(), tree.parents.tolist()
    out = []
    for i in range(tree.size):
        p, j = [], i
        while j >= 0:
            p.append(toks[j])
            j = par[j]
        out.append(tuple(reversed(p)))
    return out


def build(root: int, spec: TreeSpec, d2t=None, t2d=None) -> DraftTree:
    paths = [(root,)]

    def expand(tokens, src, level):
        nonlocal paths
        tokens = t2d(tokens) if t2d else tokens   # the hand-made drafter reads draft indices
        paths = [paths[s] + (int(t),) for s, t in zip(src.tolist(), tokens.tolist())]
        return torch.stack([path_logp(p) for p in paths])

    return draft_tree(root, path_logp((root,)), expand, spec, d2t)


@pytest.mark.parametrize("spec", [TreeSpec(3, 2, 6), TreeSpec(4, 3, 12), TreeSpec(2, 4, 30), TreeSpec(5, 1, 4),
                                  TreeSpec(0, 3, 3), TreeSpec(3, 2, 1)])
def test_draft_tree_matches_reference_expansion(spec):
    tree = build(3, spec)
    ref = naive_eagle2(3, spec)
    best = sorted(ref, key=ref.get, reverse=True)[: spec.total_tokens - 1]
    assert tree.size <= spec.total_tokens and tree.size == 1 + len(best)
    assert int(tree.depths.max()) <= spec.depth + 1
    paths = tree_paths(tree)
    assert paths[0] == (3,) and set(paths[1:]) == set(best)
    assert tree.depths.tolist() == [len(p) - 1 for p in paths]
    assert all(p < i for i, p in enumerate(tree.parents.tolist()) if i)   # parents precede children
    assert tree.positions(17).tolist() == [17 + d for d in tree.depths.tolist()]


def test_expansion_stops_once_no_deeper_node_can_enter_the_tree():
    calls = []

    def flat(tokens, src, level):
        calls.append(level)
        return torch.log_softmax(torch.zeros(tokens.numel(), 6), -1)

    root_logp = torch.log_softmax(torch.tensor([2.0, 2.0, 2.0, 0.0, 0.0, 0.0]), -1)
    tree = draft_tree(0, root_logp, flat, TreeSpec(3, 3, 4))
    assert calls == [] and tree.depths.tolist() == [0, 1, 1, 1]        # three equal first-level nodes fill it
    tree = draft_tree(0, root_logp, flat, TreeSpec(3, 3, 5))
    assert calls == [1] and tree.depths.tolist() == [0, 1, 1, 1, 2]    # a level-3 node could not beat a level-2 one
    # on the hand-made drafter: trees equal the full expansion's, and some of them skipped steps
    skipped = 0
    for root in range(V):
        for spec in (TreeSpec(3, 2, 4), TreeSpec(4, 3, 6)):
            calls.clear()
            paths = [(root,)]

            def expand(tokens, src, level):
                nonlocal paths
                calls.append(level)
                paths = [paths[s] + (int(t),) for s, t in zip(src.tolist(), tokens.tolist())]
                return torch.stack([path_logp(p) for p in paths])

            tree = draft_tree(root, path_logp((root,)), expand, spec)
            ref = naive_eagle2(root, spec)
            assert set(tree_paths(tree)[1:]) == set(sorted(ref, key=ref.get, reverse=True)[: spec.total_tokens - 1])
            skipped += len(calls) < spec.depth
    assert skipped > 0


def test_ancestor_mask_is_ancestors_and_self():
    tree = build(5, TreeSpec(4, 3, 16))
    mask = tree.ancestor_mask()
    par = tree.parents.tolist()
    for i in range(tree.size):
        anc, j = set(), i
        while j >= 0:
            anc.add(j)
            j = par[j]
        assert set(mask[i].nonzero().flatten().tolist()) == anc
    assert torch.equal(mask, ancestor_mask(tree.parents, tree.depths))


def test_chain_drafting_is_top_k_one():
    tree = build(2, TreeSpec(5, 1, 20))
    assert tree.is_chain and tree.size == chain_length(TreeSpec(5, 1, 20)) + 1 == 7
    assert TreeSpec.chain(4) == TreeSpec(3, 1, 5) and chain_length(TreeSpec.chain(4)) == 4


def test_d2t_maps_draft_indices_to_target_ids():
    d2t = torch.arange(V) * 7 + 100
    plain, mapped = build(1, TreeSpec(2, 2, 7)), build(1, TreeSpec(2, 2, 7), d2t, lambda t: (t - 100) // 7)
    assert torch.equal(mapped.tokens[1:], d2t[plain.tokens[1:]]) and torch.equal(mapped.parents, plain.parents)


def test_bad_tree_spec_is_a_clear_error():
    with pytest.raises(ValueError, match="depth, top_k, total_tokens"):
        TreeSpec.of([8, 10])
    with pytest.raises(ValueError, match="top_k >= 1"):
        TreeSpec(3, 0, 5)


def test_accept_takes_longest_correct_path_and_bonus():
    #        0(r)
    #      /   \
    #     1:a   2:b
    #     |      |
    #     3:c   4:d -- 5:e
    t = lambda x: torch.tensor(x)  # noqa: E731
    tree = DraftTree(t([9, 1, 2, 3, 4, 5]), t([-1, 0, 0, 1, 2, 4]), t([0, 1, 1, 2, 2, 3]))
    # target: after r -> 2 (b), after b -> 4 (d), after d -> 7 (not e): accept r,b,d; bonus 7
    argmax = t([2, 0, 4, 0, 7, 0])
    path, bonus = accept(tree, argmax)
    assert path.tolist() == [0, 2, 4] and bonus == 7
    path, bonus = accept(tree, t([8, 0, 0, 0, 0, 0]))
    assert path.tolist() == [0] and bonus == 8


def random_prompt(n: int, seed: int, vocab: int = 256) -> torch.Tensor:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_verify_matches_plain_forward_and_compaction_matches_fresh_cache(arch):
    tgt = tiny_target(arch)
    prompt = random_prompt(9, 0)
    cap, _ = prefill(tgt, prompt)
    cache = cap.cache
    g = torch.Generator().manual_seed(1)
    tree = build(int(torch.randint(0, V, (1,), generator=g)), TreeSpec(3, 3, 12))
    past = cache.get_seq_length()
    v = verify(tgt, tree, cache)
    # each node's logits equal a plain causal forward over prompt + its root path
    for i, p in enumerate(tree_paths(tree)):
        ids = torch.cat([prompt, torch.tensor(p)])
        ref = tgt.logits(tgt.capture(ids[None]).last_hidden[0, -1])
        torch.testing.assert_close(v.logits[i], ref, atol=1e-4, rtol=1e-4)
    # force a non-prefix acceptance: accept the deepest node's path
    deepest = int(tree.depths.argmax())
    path = tree.ancestor_mask()[deepest].nonzero().flatten()
    assert path.tolist() != list(range(path.numel()))
    compact_cache(cache, past, path)
    fresh = tgt.capture(torch.cat([prompt, tree.tokens[path]])[None], keep_cache=True).cache
    for mine, ref in zip(cache.layers, fresh.layers):
        torch.testing.assert_close(mine.keys, ref.keys, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(mine.values, ref.values, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_lossless_fp32_every_proposer(arch):
    tgt = tiny_target(arch)
    other = tiny_target(arch, seed=7)
    for seed in range(2):
        prompt = random_prompt(10, seed)
        ref = greedy_generate(tgt, prompt, 32)
        full = prompt.tolist() + ref.tokens
        runs = {
            "off": speculative_generate(tgt, prompt, 32),
            "oracle-chain": speculative_generate(tgt, prompt, 32, OracleProposer(full), TreeSpec.chain(5)),
            "oracle-branch": speculative_generate(tgt, prompt, 32, OracleProposer(full, True, 256), [3, 2, 12]),
            "other-tree": speculative_generate(tgt, prompt, 32, CallableProposer(lm_log_probs(other.model)),
                                               [4, 3, 12]),
            "other-chain": speculative_generate(tgt, prompt, 32, CallableProposer(lm_log_probs(other.model)),
                                                [4, 1, 6]),
        }
        for name, res in runs.items():
            assert res.tokens == ref.tokens, (arch, seed, name, first_divergence(ref.tokens, res.tokens))
        assert runs["off"].tau == 1.0 and runs["off"].rounds == 31


def test_oracle_tau_is_the_tree_depth_plus_one():
    tgt = tiny_target("llama")
    prompt = random_prompt(8, 3)
    n = 1 + 6 * 5  # prefill token + 6 full rounds of 5
    ref = greedy_generate(tgt, prompt, n)
    full = prompt.tolist() + ref.tokens
    # chain of 4 drafts: depth 3 gives levels 1..4
    res = speculative_generate(tgt, prompt, n, OracleProposer(full), TreeSpec(3, 1, 5))
    assert res.accept_lengths == [5] * 6 and res.tau == 5.0 and res.tokens == ref.tokens
    # a node budget below the levels caps the chain: total_tokens = depth + 1 gives tau = depth + 1
    res = speculative_generate(tgt, prompt, n, OracleProposer(full), TreeSpec(6, 1, 7))
    assert res.accept_lengths == [7, 7, 7, 7, 3] and res.tokens == ref.tokens   # the last round runs out of reference
    # with a wrong sibling per level the same budget holds 3 levels
    res = speculative_generate(tgt, prompt, n, OracleProposer(full, True, 256), TreeSpec(6, 2, 7))
    assert res.accept_lengths[:-1] == [4] * 7 and res.tokens == ref.tokens
    # the time split the benchmark prints: verification and drafting are disjoint parts of the wall time
    assert res.verify_seconds > 0 and res.draft_seconds > 0
    assert res.verify_seconds + res.draft_seconds < res.seconds


def test_eos_stops_every_loop_at_the_same_token():
    tgt = tiny_target("llama")
    prompt = random_prompt(10, 4)
    free = greedy_generate(tgt, prompt, 24).tokens
    eos = free[5]
    ref = greedy_generate(tgt, prompt, 24, eos_token_id=eos)
    assert ref.tokens == free[: free.index(eos) + 1]
    full = prompt.tolist() + free
    for res in (speculative_generate(tgt, prompt, 24, eos_token_id=eos),
                speculative_generate(tgt, prompt, 24, OracleProposer(full), [4, 1, 6], eos_token_id=eos),
                prompt_lookup_generate(tgt, prompt, 24, eos_token_id=eos)):
        assert res.tokens == ref.tokens


def test_prompt_lookup_baseline_reports_tau_and_share():
    tgt = tiny_target("llama")
    prompt = torch.tensor([5, 6, 7, 8] * 4)
    ref = greedy_generate(tgt, prompt, 20)
    pl = prompt_lookup_generate(tgt, prompt, 20, num_tokens=4)
    assert pl.tokens == ref.tokens and pl.rounds >= 1
    assert math.isclose(pl.tau, 19 / pl.rounds) and 0.0 <= pl.draft_share < 1.0


def test_checks():
    assert first_divergence([1, 2, 3], [1, 2, 3]) is None and exact_match([1], [1])
    assert first_divergence([1, 2, 3], [1, 5, 3]) == 1 and first_divergence([1, 2], [1, 2, 3]) == 2
    logits = [torch.tensor([0.0, 5.0, 4.9]), torch.tensor([1.0, 0.0, 0.0])]
    near = lossless_at_near_tie([1, 0], logits, [2, 1], tolerance=0.25)
    assert near.lossless and not near.exact and near.divergence == 0 and near.gap == pytest.approx(0.1)
    far = lossless_at_near_tie([1, 0], logits, [1, 2], tolerance=0.25)
    assert not far.lossless and far.divergence == 1 and far.gap == pytest.approx(1.0)
    assert lossless_at_near_tie([1, 0], logits, [1, 0], 0.0).exact


def _chat_prompt(target, text: str) -> torch.Tensor:
    return torch.tensor(target.chat_ids([{"role": "user", "content": text}], add_generation_prompt=True))


PROMPTS = ["What is the capital of France? Answer in one sentence.", "Write a haiku about the sea."]


def test_embedded_fp32_lossless_short():
    from tests.conftest import ROOT
    from models.target import load_target

    tgt = load_target("embedded", dtype="float32", cache_dir=ROOT / "scratch" / "models")
    prompt = _chat_prompt(tgt, PROMPTS[0])
    eos = tgt.tokenizer.eos_token_id
    ref = greedy_generate(tgt, prompt, 24, eos_token_id=eos)
    full = prompt.tolist() + ref.tokens
    for res in (speculative_generate(tgt, prompt, 24, eos_token_id=eos),
                speculative_generate(tgt, prompt, 24, OracleProposer(full, True, tgt.vocab_size), [4, 2, 10],
                                     eos_token_id=eos)):
        assert res.tokens == ref.tokens


def test_embedded_bf16_diverges_only_at_near_ties(embedded_target):
    tgt = embedded_target
    eos = tgt.tokenizer.eos_token_id
    for text in PROMPTS:
        prompt = _chat_prompt(tgt, text)
        ref = greedy_generate(tgt, prompt, 40, eos_token_id=eos, keep_logits=True)
        assert len(ref.logits) == len(ref.tokens)
        full = prompt.tolist() + ref.tokens
        for res in (speculative_generate(tgt, prompt, 40, OracleProposer(full), [5, 1, 7], eos_token_id=eos),
                    speculative_generate(tgt, prompt, 40, OracleProposer(full, True, tgt.vocab_size), [3, 2, 10],
                                         eos_token_id=eos)):
            check = lossless_at_near_tie(ref.tokens, ref.logits, res.tokens, tolerance=0.25)
            assert check.lossless, (text, check)


# -- real drafters ----------------------------------------------------------------------------------------------

from models.decoding.drafter_proposer import DrafterProposer  # noqa: E402
from models.quant import quantize_linears_int8  # noqa: E402
from tests.drafter_helpers import make_drafter, naive_logits, tiny  # noqa: E402

DRAFTERS = [dict(variant="eagle3", depth=1), dict(variant="kv_only", depth=2, rope_fix=True),
            dict(variant="kv_only", depth=1, injection="head_concat"), dict(variant="hybrid", depth=1),
            dict(variant="cross_only", depth=1), dict(variant="eagle3", depth=1, fc_norm=True, norm_output=True),
            dict(variant="kv_only", depth=1, no_target=True),
            dict(variant="kv_only", depth=2, no_target=True, token_context=True)]


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
@pytest.mark.parametrize("kw", DRAFTERS, ids=lambda kw: "-".join(str(v) for v in kw.values()))
def test_lossless_fp32_untrained_drafters(arch, kw):
    tgt = tiny(arch)
    drafter = make_drafter(tgt, draft_vocab_size=48, **kw)
    drafter.set_vocab(torch.randperm(64, generator=torch.Generator().manual_seed(2))[:48].sort().values)
    prompt = random_prompt(10, 0, vocab=64)
    ref = greedy_generate(tgt, prompt, 24)
    for model in (drafter, quantize_linears_int8(drafter)):    # int8 drafts differ; the output may not
        for spec in ([4, 1, 6], [3, 3, 12]):
            res = speculative_generate(tgt, prompt, 24, DrafterProposer(model, tgt), spec)
            assert res.tokens == ref.tokens, (kw, spec, first_divergence(ref.tokens, res.tokens))


class _Recording(DrafterProposer):
    """Records every drafter step's entries with their (t, k) in the EAGLE alignment."""

    def __init__(self, drafter, target):
        super().__init__(drafter, target)
        self.entries = []          # (t, k, fed tokens of the chain so far, logits [V_draft])
        self._catching = False
        step = drafter.step

        def recorded(ids, h, pos, *args, last_only=False):
            logits, hid = step(ids, h, pos, *args)      # every entry's logits, to record them all
            for j, (tok, p) in enumerate(zip(ids[0].tolist(), pos[0].tolist())):
                if self._catching:
                    self.entries.append((p - 1, 0, [], logits[0, j]))
                else:
                    base = self._stable
                    self._chain.append(tok)
                    self.entries.append((base - 1, p - base, list(self._chain), logits[0, j]))
            return (logits[:, -1:] if last_only else logits), hid

        drafter.step = recorded

    def _catch_up(self, root):
        self._catching, self._chain = True, []
        try:
            return super()._catch_up(root)
        finally:
            self._catching = False


@pytest.mark.parametrize("kw", DRAFTERS, ids=lambda kw: "-".join(str(v) for v in kw.values()))
def test_drafter_in_decoding_sees_what_it_sees_in_training(kw):
    """Every drafter entry during chain decoding (catch-up and draft steps, across rounds, with rejected
    branches dropped) equals the step-by-step reference over the final sequence: same target features/KV,
    same alignment, same positions."""
    tgt = tiny("llama")
    drafter = make_drafter(tgt, **kw)
    prompt = random_prompt(8, 1, vocab=64)
    rec = _Recording(drafter, tgt)
    res = speculative_generate(tgt, prompt, 20, rec, [3, 1, 5])
    seq = torch.cat([prompt, torch.tensor(res.tokens)])
    cap = tgt.capture(seq[None])
    del drafter.step                              # back to the class method for the reference
    ref = naive_logits(drafter, seq[None], torch.cat(cap.features, -1), cap.kv, steps=5)
    checked = 0
    for t, k, chain, logits in rec.entries:
        if k and chain != seq[t + 2: t + 2 + len(chain)].tolist():
            continue                              # a draft chain that left the final sequence
        if t + 1 + k >= seq.numel():
            continue
        torch.testing.assert_close(logits, ref[k, 0, t], atol=1e-4, rtol=1e-4)
        checked += 1
    assert checked >= seq.numel() - prompt.numel()


# -- prompt lookup as a draft source --------------------------------------------------------------------------------

from models.decoding import LookupProposer, NgramIndex, graft_chain  # noqa: E402


def naive_continuation(seq: list[int], max_ngram: int, num_tokens: int) -> list[int]:
    """Latest earlier occurrence of the longest suffix n-gram, by scanning."""
    for n in range(min(max_ngram, len(seq) - 1), 0, -1):
        for start in range(len(seq) - n - 1, -1, -1):
            if seq[start:start + n] == seq[-n:]:
                return seq[start + n:start + n + num_tokens]
    return []


def test_ngram_index_matches_a_scan():
    g = torch.Generator().manual_seed(0)
    for trial in range(30):
        seq = torch.randint(0, 4 + trial % 5, (40,), generator=g).tolist()
        index = NgramIndex(max_ngram=3)
        index.extend(seq[:7])
        for cut in range(7, 40):
            assert index.continuation(seq[cut], 5) == naive_continuation(seq[:cut + 1], 3, 5), (trial, cut)
            index.extend([seq[cut]])
    index = NgramIndex(2)
    index.extend([1, 2, 3, 9, 2, 3, 7, 8])
    assert index.continuation(3, 4) == [7, 8, 3]          # (2, 3) last seen before 7: the latest occurrence wins
    assert index.continuation(5, 4) == []                  # never seen
    with pytest.raises(ValueError, match="max_ngram=0"):
        NgramIndex(0)


def test_graft_chain_shares_the_prefix_and_keeps_the_tree_valid():
    tree = DraftTree(torch.tensor([9, 4, 5, 6]), torch.tensor([-1, 0, 0, 1]), torch.tensor([0, 1, 1, 2]))
    grafted = graft_chain(tree, [4, 6, 7, 8])
    assert grafted.tokens.tolist() == [9, 4, 5, 6, 7, 8]
    assert grafted.parents.tolist() == [-1, 0, 0, 1, 3, 4] and grafted.depths.tolist() == [0, 1, 1, 2, 3, 4]
    assert (9, 4, 6, 7, 8) in tree_paths(grafted) and set(tree_paths(tree)) <= set(tree_paths(grafted))
    new = graft_chain(tree, [1, 2])                        # no shared prefix: a fresh branch under the root
    assert new.parents.tolist()[4:] == [0, 4] and new.depths.tolist()[4:] == [1, 2]
    assert graft_chain(tree, []) is tree and graft_chain(tree, [4, 6]).size == 4
    mask = grafted.ancestor_mask()
    for i, parent in enumerate(grafted.parents.tolist()):
        if parent >= 0:
            assert mask[i, parent] and mask[i].sum() == grafted.depths[i] + 1


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_lossless_fp32_with_lookup(arch):
    tgt = tiny(arch)
    drafter = make_drafter(tgt, draft_vocab_size=48, variant="eagle3", depth=1)
    drafter.set_vocab(torch.arange(48))
    for seed, prompt in enumerate([random_prompt(10, 0, vocab=64), torch.tensor([5, 6, 7, 8, 9] * 4)]):
        ref = greedy_generate(tgt, prompt, 32)
        alone = speculative_generate(tgt, prompt, 32, LookupProposer(num_tokens=6), [0, 1, 1])
        grafted = speculative_generate(tgt, prompt, 32, LookupProposer(DrafterProposer(drafter, tgt), 6),
                                       [3, 2, 6])
        for res in (alone, grafted):
            assert res.tokens == ref.tokens, (arch, seed, first_divergence(ref.tokens, res.tokens))


def test_lookup_rounds_accept_what_the_lookup_predicted():
    """Each round emits the longest prefix of the n-gram continuation that matches plain greedy, plus one."""
    tgt = tiny("llama")
    for prompt in (random_prompt(12, 5, vocab=8), torch.tensor([5, 6, 7, 8, 9] * 4)):
        ref = greedy_generate(tgt, prompt, 48).tokens    # the last round may draft past the 40 asked for
        res = speculative_generate(tgt, prompt, 40, LookupProposer(num_tokens=4, max_ngram=2), [0, 1, 1])
        assert res.tokens == ref[:40]
        seq, emitted, expected = prompt.tolist(), 1, []
        while emitted < 40:
            draft = naive_continuation(seq + ref[:emitted], 2, 4)
            n = 0
            while n < len(draft) and draft[n] == ref[emitted + n]:
                n += 1
            expected.append(n + 1)
            emitted += n + 1
        assert res.accept_lengths == expected
    assert max(res.accept_lengths) > 1            # the repeated prompt is copied


def test_device_clock_waits_for_cuda_work(monkeypatch):
    """Timers on CUDA read the time after the queued kernels have run (they run asynchronously); on the CPU the
    clock is plain perf_counter."""
    import time

    from models.decoding.generate import device_clock

    assert device_clock("cpu") is time.perf_counter
    waited = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: waited.append(device))
    clock = device_clock("cuda:0")
    t0 = clock()
    assert clock() >= t0 and waited == [torch.device("cuda:0")] * 2
