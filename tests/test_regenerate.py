"""regenerate: turn-by-turn conditioning, the OpenAI-compatible backend on a local server, kill and resume."""
import json
import signal
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from stages.common import Paths, TargetParams, read_jsonl
from stages.regenerate import regenerate_rows
from stages.regenerate_backends import Answer, OpenAIBackend, RegenerateParams
from stages.regenerate_resume import partial_paths

ROOT = Path(__file__).resolve().parent.parent


def conv(i: int, turns: int = 2, system: bool = False) -> dict:
    msgs = [{"role": "system", "content": "Be brief."}] if system else []
    for t in range(turns):
        msgs += [{"role": "user", "content": f"q{i}.{t}"}, {"role": "assistant", "content": f"old{i}.{t}"}]
    return {"id": f"c{i}", "source": "s", "split": "train", "scale_rank": i, "messages": msgs}


class EchoBackend:
    """Answers from the history it is given, so the test can see what each turn was conditioned on."""

    def __init__(self):
        self.seen = []

    def answer(self, histories):
        self.seen += histories
        out = []
        for h in histories:
            if h[-1]["content"] == "q1.0":
                out.append(Answer(None, reason="prompt over max_prompt_tokens"))
            elif h[-1]["content"] == "q2.1":
                out.append(Answer(None, reason="prompt over max_prompt_tokens"))
            else:
                out.append(Answer("re:" + "|".join(m["content"] for m in h), tokens=3))
        return out


def test_turn_by_turn_conditioning_and_drops(tmp_path):
    rows = [conv(0, system=True), conv(1), conv(2), conv(3, turns=1)]
    final = tmp_path / "out.jsonl"
    stats = regenerate_rows(rows, final, RegenerateParams(batch_size=2, window=1), TargetParams(), Paths(tmp_path),
                            backend=EchoBackend())
    got = {r["id"]: r for r in read_jsonl(final)}
    assert set(got) == {"c0", "c2", "c3"} and stats["dropped"] == 1 and stats["ended_early"] == 1
    c0 = got["c0"]["messages"]
    assert [m["role"] for m in c0] == ["system", "user", "assistant", "user", "assistant"]
    assert c0[2]["content"] == "re:Be brief.|q0.0"
    assert c0[4]["content"] == "re:Be brief.|q0.0|re:Be brief.|q0.0|q0.1"   # conditioned on the new answer
    assert len(got["c2"]["messages"]) == 2 and got["c2"]["ended"] == "prompt over max_prompt_tokens"
    assert got["c0"]["gen_tokens"] == 6 and not partial_paths(final)


class ChatHandler(BaseHTTPRequestHandler):
    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        msgs = body["messages"]
        if msgs[-1]["content"] == "q1.0":
            self.send_response(400)
            self.end_headers()
            return
        text = f"{body['model']} says {len(msgs)}:{msgs[-1]['content']}"
        if len(msgs) > 2:
            text += f" after {msgs[-2]['content']}"
        reply = {"choices": [{"message": {"role": "assistant", "content": text}, "finish_reason": "stop"}],
                 "usage": {"completion_tokens": 5}}
        data = json.dumps(reply).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


def test_openai_backend_against_a_local_server(tmp_path):
    server = ThreadingHTTPServer(("127.0.0.1", 0), ChatHandler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}/v1"
        params = RegenerateParams(backend="openai", servers=[url, url], concurrency=3, batch_size=2)
        final = tmp_path / "out.jsonl"
        stats = regenerate_rows([conv(i) for i in range(6)], final, params, TargetParams(), Paths(tmp_path),
                                backend=OpenAIBackend(params, "m"))
    finally:
        server.shutdown()
    got = read_jsonl(final)
    assert [r["id"] for r in got] == ["c0", "c2", "c3", "c4", "c5"] and stats["tokens"] == 5 * 2 * 5
    assert got[0]["messages"][1]["content"] == "m says 1:q0.0"
    assert got[0]["messages"][3]["content"] == "m says 3:q0.1 after m says 1:q0.0"


SCRIPT = """
import sys, json
from pathlib import Path
import torch
torch.set_num_threads(1)
from transformers import AutoTokenizer
from models.target import tiny_target
from stages.common import Paths, TargetParams, read_jsonl
from stages.regenerate import regenerate_rows
from stages.regenerate_backends import RegenerateParams, TransformersBackend
tok_dir, rows_file, final = sys.argv[1:4]
tok = AutoTokenizer.from_pretrained(tok_dir)
target = tiny_target(vocab_size=len(tok), tokenizer=tok, num_layers=4)
target.model.generation_config.eos_token_id = tok.eos_token_id
params = RegenerateParams(max_new_tokens=24, batch_size=2, window=1, max_prompt_tokens=64)
regenerate_rows(read_jsonl(rows_file), Path(final), params, TargetParams(), Paths(Path(final).parent),
                backend=TransformersBackend(target, params))
"""


@pytest.mark.slow
def test_killed_run_resumes_to_the_same_file(tmp_path, embedded_tokenizer):
    tok_dir = tmp_path / "tok"
    embedded_tokenizer.save_pretrained(tok_dir)
    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(json.dumps(conv(i)) + "\n" for i in range(16)))
    script = tmp_path / "regen.py"
    script.write_text(SCRIPT)

    def start(final: Path) -> subprocess.Popen:
        return subprocess.Popen([sys.executable, str(script), str(tok_dir), str(rows), str(final)], cwd=ROOT,
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)

    whole = tmp_path / "a" / "out.jsonl"
    assert start(whole).wait(timeout=300) == 0
    killed = tmp_path / "b" / "out.jsonl"
    proc = start(killed)
    deadline = time.time() + 240
    while time.time() < deadline:  # wait until some conversations are on disk, then kill hard
        parts = partial_paths(killed)
        if parts and len(parts[0].read_text().splitlines()) >= 1 + 4:
            break
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert not killed.exists(), "the run finished before it could be killed"
    done_before = len(partial_paths(killed)[0].read_text().splitlines()) - 1
    assert 4 <= done_before < 16
    assert start(killed).wait(timeout=300) == 0
    assert killed.read_text() == whole.read_text()
    ids = [r["id"] for r in read_jsonl(killed)]
    assert len(ids) == len(set(ids)) and not partial_paths(killed)


def test_the_summary_line_names_why_conversations_were_dropped():
    from stages.regenerate import _reasons

    stats = {"dropped": 3, "dropped/prompt over max_prompt_tokens": 2, "dropped/no answer": 1, "kept": 9}
    assert _reasons(stats) == " (prompt over max_prompt_tokens: 2, no answer: 1)"
    assert _reasons({"dropped": 0, "kept": 9}) == ""


def test_rows_past_the_budget_keep_the_dataset_answers_and_are_never_generated(tmp_path):
    rows = [dict(conv(i), split="eval" if i == 4 else "train", scale_rank=i if i < 4 else 0) for i in range(6)]
    rows[5]["scale_rank"] = 9
    final = tmp_path / "out.jsonl"
    backend = EchoBackend()
    params = RegenerateParams(batch_size=2, window=1, original_answers_from=2)
    stats = regenerate_rows(rows, final, params, TargetParams(), Paths(tmp_path), backend=backend)
    got = {r["id"]: r for r in read_jsonl(final)}
    asked = {h[-1]["content"].split(".")[0] for h in backend.seen}
    assert asked == {"q0", "q1", "q4"}            # ranks >= 2 never reach the backend (c1 is dropped there)
    assert set(got) == {"c0", "c2", "c3", "c4", "c5"} and stats["dataset_answers"] == 3
    for i in (2, 3, 5):
        assert got[f"c{i}"]["messages"] == rows[i]["messages"] and got[f"c{i}"]["answers"] == "dataset"
    assert got["c4"]["messages"][1]["content"].startswith("re:")   # eval rows are always the target's
    assert stats["resumed"] == 0 and stats["conversations"] == 6


def test_a_grown_row_set_reuses_the_finished_conversations(tmp_path):
    final = tmp_path / "out.jsonl"
    params = RegenerateParams(batch_size=2, window=1)
    first = regenerate_rows([conv(i) for i in range(4)], final, params, TargetParams(), Paths(tmp_path),
                            backend=EchoBackend())
    before = {r["id"]: r for r in read_jsonl(final)}
    assert first["resumed"] == 0 and set(before) == {"c0", "c2", "c3"}      # c1 dropped

    backend = EchoBackend()
    stats = regenerate_rows([conv(i) for i in range(6)], final, params, TargetParams(), Paths(tmp_path),
                            backend=backend)
    asked = {h[-1]["content"].split(".")[0] for h in backend.seen}
    assert asked == {"q4", "q5"}                   # finished (and dropped) conversations are not asked again
    after = {r["id"]: r for r in read_jsonl(final)}
    assert set(after) == {"c0", "c2", "c3", "c4", "c5"} and stats["resumed"] == 4 and stats["dropped"] == 1
    assert all(after[k] == before[k] for k in before)

    changed = [conv(i) for i in range(6)]
    changed[0]["messages"][0]["content"] = "a new question"
    backend = EchoBackend()
    regenerate_rows(changed, final, params, TargetParams(), Paths(tmp_path), backend=backend)
    assert backend.seen and all(h[0]["content"] == "a new question" for h in backend.seen)   # only the changed one

    backend = EchoBackend()                          # other settings: nothing is reused
    regenerate_rows(changed, final, RegenerateParams(batch_size=3, window=1), TargetParams(), Paths(tmp_path),
                    backend=backend)
    assert len({h[0]["content"] for h in backend.seen}) == 6


def test_answers_with_unicode_line_separators_survive_the_partial_file(tmp_path):
    """JSON keeps U+2028 and U+0085 raw (ensure_ascii=False): lines are split on newlines only."""
    rows = [conv(i, turns=1) for i in range(3)]
    rows[0]["messages"][0]["content"] = "first\u2028second\x85third"
    final = tmp_path / "out.jsonl"
    regenerate_rows(rows, final, RegenerateParams(batch_size=2, window=1), TargetParams(), Paths(tmp_path),
                    backend=EchoBackend())
    got = {r["id"]: r for r in read_jsonl(final)}
    assert got["c0"]["messages"][1]["content"] == "re:first\u2028second\x85third" and len(got) == 2   # c1 dropped


class LengthBackend(EchoBackend):
    """Echoes; a first prompt with LONG is over the token limit, one with EMPTY gets an empty answer."""

    def too_long(self, history):
        return "LONG" in history[-1]["content"]

    def answer(self, histories):
        self.seen += histories
        return [Answer(None, reason="prompt over max_prompt_tokens") if self.too_long(h)
                else Answer(None, reason="empty answer") if "EMPTY" in h[-1]["content"]
                else Answer("re:" + h[-1]["content"], tokens=2) for h in histories]


def _candidates(prompts: list[str], eval_size: int) -> list[dict]:
    rows = []
    for rank, p in enumerate(prompts):
        row = conv(rank, turns=1)
        row.update(id=f"e{rank}", split="eval" if rank < eval_size else "reserve", scale_rank=rank, used=True)
        row["messages"][0]["content"] = p
        rows.append(row)
    return rows


def test_the_eval_split_is_the_first_candidates_that_fit(tmp_path):
    from stages.prepare import write_jsonl
    from stages.regenerate import run

    paths = Paths(tmp_path)
    # prepare's eval split e0..e3 and reserve e4..e7 (ranked); e1 and e4 are over the limit, e2 gets no answer
    prompts = ["a", "b LONG", "c EMPTY", "d", "e LONG", "f", "g", "h"]
    train = [dict(conv(10 + i, turns=1), used=True) for i in range(3)]
    write_jsonl(paths.prepared("s"), _candidates(prompts, 4)[::-1] + train)
    backend, metrics = LengthBackend(), {}
    run(RegenerateParams(batch_size=2, window=1), TargetParams(), ["s"], paths,
        lambda m, step=None: metrics.update(m), backend=backend)
    got = read_jsonl(paths.regenerated("s"))
    evals = [r["id"] for r in got if r["split"] == "eval"]
    assert evals == ["e0", "e3", "e5", "e6"]          # 4 = eval_size: e1, e4 skipped, e2 refilled by e6
    assert not {r["split"] for r in got} - {"eval", "train"} and len(got) == 4 + 3
    asked = {h[-1]["content"] for h in backend.seen}
    assert not {"b LONG", "e LONG", "h"} & asked       # over-long ones never generated, the spare left unused
    m = {k.removeprefix("regenerate/s/"): v for k, v in metrics.items()}
    assert m["eval_wanted"] == 4 == m["eval_kept"] and m["eval_candidates"] == 8 and m["eval_over_long"] == 2
    assert m["eval_from_reserve"] == 1 and m["eval_refilled"] == 1 and m["dropped"] == 1   # e2's empty answer


def test_too_few_fitting_candidates_evaluate_what_fits(tmp_path, capsys):
    from stages.prepare import write_jsonl
    from stages.regenerate import run

    paths = Paths(tmp_path)
    write_jsonl(paths.prepared("s"), _candidates(["a LONG", "b", "c LONG", "d LONG"], 2))
    metrics = {}
    run(RegenerateParams(batch_size=2, window=1), TargetParams(), ["s"], paths,
        lambda m, step=None: metrics.update(m), backend=LengthBackend())
    assert [r["id"] for r in read_jsonl(paths.regenerated("s"))] == ["e1"]
    assert metrics["regenerate/s/eval_kept"] == 1 and metrics["regenerate/s/eval_over_long"] == 3
    assert "only 1 of 2 eval conversations" in " ".join(capsys.readouterr().err.split())
