#!/usr/bin/env python3
"""tools/train-adapter's checks that need no torch: catalog validation, the train / held-out
split, the held-out files for moe-eval-recall, the CLIP directory check, the arguments and the
batch fitting. Runs with Debian's python3 alone (CI has no torch); the training itself is
checked by hand (docs/real-models.md, "Check the tool")."""

import json
import os
import sys
import tempfile
import unittest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tools", "train"))
import train_adapter  # noqa: E402  (imports torch only inside main())
import user_catalog  # noqa: E402


class CatalogDir:
    """A temporary folder with empty image files and a catalog.jsonl of the given lines."""

    def __init__(self, lines, images=()):
        self.tmp = tempfile.TemporaryDirectory()
        self.dir = self.tmp.name
        for name in images:
            path = os.path.join(self.dir, name)
            os.makedirs(os.path.dirname(path), exist_ok=True)
            open(path, "wb").close()
        self.path = os.path.join(self.dir, "catalog.jsonl")
        with open(self.path, "w") as fh:
            for line in lines:
                fh.write((line if isinstance(line, str) else json.dumps(line)) + "\n")

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.tmp.cleanup()


def numbered(n, **extra):
    return [dict({"path": "img/%03d.png" % i, "caption": "item %d" % i}, **extra)
            for i in range(n)], ["img/%03d.png" % i for i in range(n)]


class LoadCatalog(unittest.TestCase):
    def test_reads_items_as_the_engine_does(self):
        with tempfile.TemporaryDirectory() as other:
            outside = os.path.join(other, "abs.png")
            open(outside, "wb").close()
            lines = [{"path": "a.png", "caption": "a red mug", "price": 3},
                     "",
                     {"path": "sub/b.jpg", "caption": "a lamp", "id": 7},
                     {"path": outside, "caption": "a hat", "id": "h1"},
                     {"path": "./a.png", "caption": "a mug that is red"},
                     {"path": "a.png", "caption": "a red mug"}]
            with CatalogDir(lines, ["a.png", "sub/b.jpg"]) as c:
                items = user_catalog.load_catalog(c.path)
                self.assertEqual([it.id for it in items], ["a", "7", "h1"])
                self.assertEqual(items[0].path, os.path.join(c.dir, "a.png"))
                self.assertEqual(items[0].captions, ["a red mug", "a mug that is red"])
                self.assertEqual(items[1].path, os.path.join(c.dir, "sub", "b.jpg"))
                self.assertEqual(items[2].path, outside)

    def assert_refused(self, lines, images, *fragments):
        with CatalogDir(lines, images) as c:
            with self.assertRaises(user_catalog.CatalogError) as cm:
                user_catalog.load_catalog(c.path)
            for f in fragments:
                self.assertIn(f, str(cm.exception))
            return str(cm.exception)

    def test_refuses_bad_lines_naming_file_and_line(self):
        good, images = numbered(2)
        cases = [("{not json", "line 3: not JSON"),
                 ("[1, 2]", "line 3: not a JSON object"),
                 ({"caption": "x"}, 'line 3: "path" must be a non-empty string'),
                 ({"path": "", "caption": "x"}, '"path" must be a non-empty string'),
                 ({"path": "img/000.png"}, 'line 3: no "caption"'),
                 ({"path": "img/000.png", "caption": "  "}, 'no "caption"'),
                 ({"path": "img/000.png", "caption": "x", "id": [1]}, '"id" must be a string'),
                 ({"path": "img/000.png", "caption": "x", "id": True}, '"id" must be a string'),
                 ({"path": "missing.png", "caption": "x"}, "missing.png not found")]
        for line, fragment in cases:
            with self.subTest(line=line):
                msg = self.assert_refused(good + [line], images, fragment)
                self.assertIn("catalog.jsonl line 3", msg)

    def test_refuses_ids_that_name_two_images(self):
        lines, images = numbered(3)
        lines[2]["id"] = "000"
        self.assert_refused(lines, images, "line 3: id '000' already names", "(line 1)")
        lines, images = numbered(2)
        lines.append({"path": "img/001.png", "caption": "again", "id": "other"})
        self.assert_refused(lines, images, "line 3:", "is item '001' since line 2, not 'other'")

    def test_reports_every_bad_line_up_to_a_bound(self):
        lines = ["{"] * (user_catalog.MAX_REPORTED_ERRORS + 4)
        msg = self.assert_refused(lines, [], "line 1:", "... and 4 more")
        self.assertEqual(msg.count("not JSON"), user_catalog.MAX_REPORTED_ERRORS)

    def test_refuses_fewer_than_two_items(self):
        self.assert_refused([{"path": "a.png", "caption": "x"}, {"path": "a.png", "caption": "y"}],
                            ["a.png"], "1 item(s)")

    def test_unreadable_catalog(self):
        with self.assertRaises(user_catalog.CatalogError) as cm:
            user_catalog.load_catalog("/nonexistent/catalog.jsonl")
        self.assertIn("cannot read", str(cm.exception))


class Split(unittest.TestCase):
    def items(self, n, **kw):
        lines, images = numbered(n)
        with CatalogDir(lines, images) as c:
            return user_catalog.load_catalog(c.path)

    def test_exact_size_disjoint_and_in_catalog_order(self):
        items = self.items(50)
        train, held = user_catalog.split(items, 0.2, seed=1)
        self.assertEqual((len(train), len(held)), (40, 10))
        self.assertEqual(sorted(it.id for it in train + held), sorted(it.id for it in items))
        order = [it.id for it in items]
        for part in (train, held):
            ids = [it.id for it in part]
            self.assertEqual(ids, sorted(ids, key=order.index))

    def test_deterministic_and_independent_of_line_order(self):
        items = self.items(50)
        held = [it.id for it in user_catalog.split(items, 0.3, seed=4)[1]]
        again = [it.id for it in user_catalog.split(self.items(50), 0.3, seed=4)[1]]
        shuffled = [it.id for it in user_catalog.split(items[::-1], 0.3, seed=4)[1]]
        self.assertEqual(held, again)
        self.assertEqual(sorted(held), sorted(shuffled))
        other_seed = [it.id for it in user_catalog.split(items, 0.3, seed=5)[1]]
        self.assertNotEqual(sorted(held), sorted(other_seed))

    def test_growing_catalog_keeps_most_of_the_held_out_items(self):
        small = {it.id for it in user_catalog.split(self.items(100), 0.2, seed=1)[1]}
        large = {it.id for it in user_catalog.split(self.items(110), 0.2, seed=1)[1]}
        self.assertGreaterEqual(len(small & large), 15)

    def test_bounds(self):
        items = self.items(3)
        self.assertEqual(len(user_catalog.split(items, 0.0, seed=1)[1]), 0)
        self.assertEqual(len(user_catalog.split(items, 0.01, seed=1)[1]), 1)
        self.assertEqual(len(user_catalog.split(items, 0.99, seed=1)[0]), 1)
        for bad in (-0.1, 1.0, 2.0):
            with self.assertRaises(ValueError):
                user_catalog.split(items, bad, seed=1)


class HeldOutFiles(unittest.TestCase):
    def test_queries_name_every_item_with_the_caption(self):
        lines = [{"path": "a.png", "caption": "a red mug"},
                 {"path": "b.png", "caption": "a red mug"},
                 {"path": "b.png", "caption": "a tall red mug"},
                 {"path": "c.png", "caption": "a hat"}]
        with CatalogDir(lines, ["a.png", "b.png", "c.png"]) as c:
            items = user_catalog.load_catalog(c.path)
            out = os.path.join(c.dir, "held")
            queries = user_catalog.held_out_files(items, out)
            self.assertEqual([(q["text"], q["relevant"]) for q in queries],
                             [("a red mug", ["a", "b"]), ("a tall red mug", ["b"]),
                              ("a hat", ["c"])])
            with open(os.path.join(out, "queries.jsonl")) as fh:
                self.assertEqual([json.loads(l) for l in fh], queries)
            with open(os.path.join(out, "catalog.jsonl")) as fh:
                rows = [json.loads(l) for l in fh]
            self.assertEqual([(r["id"], r["path"]) for r in rows],
                             [(it.id, it.path) for it in items])
            self.assertTrue(all(os.path.isabs(r["path"]) for r in rows))


class ClipDirectory(unittest.TestCase):
    def make(self, d, config, files):
        with open(os.path.join(d, "config.json"), "w") as fh:
            fh.write(config if isinstance(config, str) else json.dumps(config))
        for f in files:
            open(os.path.join(d, f), "wb").close()

    def test_accepts_a_clip_directory_and_reports_its_weights(self):
        for weights in ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin"):
            with tempfile.TemporaryDirectory() as d:
                self.make(d, {"model_type": "clip"}, [weights, "vocab.json", "merges.txt"])
                self.assertEqual(train_adapter.check_clip_dir(d), weights)

    def test_refuses_what_is_not_a_clip_directory(self):
        cases = [(None, [], "not a Hugging Face model directory (no config.json)"),
                 ("{", [], "not JSON"),
                 ({"model_type": "bert"}, ["model.safetensors"], "model_type 'bert', not 'clip'"),
                 ({"model_type": "clip"}, ["vocab.json", "merges.txt"], "no weights"),
                 ({"model_type": "clip"}, ["model.safetensors", "vocab.json"],
                  "no tokenizer (merges.txt missing)")]
        for config, files, fragment in cases:
            with self.subTest(fragment=fragment), tempfile.TemporaryDirectory() as d:
                if config is not None:
                    self.make(d, config, files)
                with self.assertRaises(train_adapter.UsageError) as cm:
                    train_adapter.check_clip_dir(d)
                self.assertIn(fragment, str(cm.exception))
        with self.assertRaises(train_adapter.UsageError):
            train_adapter.check_clip_dir("/nonexistent/clip")


class Arguments(unittest.TestCase):
    BASE = ["--clip", "c", "--catalog", "x.jsonl", "--out", "o"]

    def test_defaults_are_the_recipe(self):
        a = train_adapter.parse_args(self.BASE)
        self.assertEqual((a.experts, a.top_k, a.steps, a.batch, a.views, a.threads, a.seed),
                         (8, 2, 1500, 256, 4, 1, 1))
        self.assertEqual((a.val_fraction, a.identity, a.replay_catalog), (0.2, 3.0, ""))

    def test_refuses_inconsistent_options(self):
        for extra in (["--top-k", "3", "--experts", "2"], ["--views", "1"], ["--steps", "0"],
                      ["--replay-frac", "1"]):
            with self.subTest(extra=extra), self.assertRaises(SystemExit):
                with open(os.devnull, "w") as null:
                    stderr, sys.stderr = sys.stderr, null
                    try:
                        train_adapter.parse_args(self.BASE + extra)
                    finally:
                        sys.stderr = stderr

    def test_fit_batch(self):
        self.assertEqual(train_adapter.fit_batch(256, 1000, 0, 0.5), 256)
        self.assertEqual(train_adapter.fit_batch(256, 240, 0, 0.5), 240)
        self.assertEqual(train_adapter.fit_batch(256, 100, 5000, 0.5), 200)  # 100 own + 100 replay
        self.assertEqual(train_adapter.fit_batch(256, 1000, 50, 0.5), 101)  # 51 own + 50 replay


if __name__ == "__main__":
    unittest.main()
