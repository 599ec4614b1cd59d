"""A user's catalog.jsonl for tools/train-adapter: validation and the train / held-out split.

No torch here (tests/test_user_catalog.py runs it with Debian's python3 alone). The lines are
read as moe-catalog-src reads them (docs/elements.md): "path" a non-empty string, relative to
the catalog's folder unless absolute; "id" a string or an integer, by default the file name
without its extension; other members are ignored here. train-adapter also needs a non-empty
"caption" on every line and the image file to exist. Lines naming the same image are one item
with several captions; two images may not share an id (the evaluation tells items apart by id).
"""

import hashlib
import json
import os

MAX_REPORTED_ERRORS = 10


class CatalogError(Exception):
    """A catalog train-adapter cannot use; the message names every problem found (up to
    MAX_REPORTED_ERRORS of them) by file and line."""


class Item:
    def __init__(self, item_id, path, key, line):
        self.id, self.path, self.key, self.line = item_id, path, key, line
        self.captions = []

    def __repr__(self):
        return "Item(%r, %r, %r)" % (self.id, self.path, self.captions)


def _id_from_path(path):
    return os.path.splitext(os.path.basename(path))[0]


def parse_line(text, folder, where):
    """(id, absolute path, path as written, caption) of one line; raises ValueError naming
    `where`."""
    try:
        obj = json.loads(text)
    except ValueError as e:
        raise ValueError("%s: not JSON (%s)" % (where, e))
    if not isinstance(obj, dict):
        raise ValueError("%s: not a JSON object" % where)
    path = obj.get("path")
    if not isinstance(path, str) or not path:
        raise ValueError('%s: "path" must be a non-empty string' % where)
    caption = obj.get("caption")
    if not isinstance(caption, str) or not caption.strip():
        raise ValueError('%s: no "caption" (train-adapter needs a caption on every line)' % where)
    item_id = obj.get("id", _id_from_path(path))
    if isinstance(item_id, bool) or not isinstance(item_id, (str, int)):
        raise ValueError('%s: "id" must be a string or an integer' % where)
    absolute = os.path.normpath(os.path.join(folder, path))
    if not os.path.isfile(absolute):
        raise ValueError("%s: image %s not found" % (where, absolute))
    return str(item_id), absolute, os.path.normpath(path), caption


def load_catalog(path):
    """The catalog's items in first-appearance order; raises CatalogError."""
    folder = os.path.dirname(os.path.abspath(path))
    try:
        with open(path, encoding="utf-8") as fh:
            lines = fh.read().splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise CatalogError("catalog %s: cannot read (%s)" % (path, e))
    errors, items, by_path, by_id = [], [], {}, {}
    for n, text in enumerate(lines, 1):
        if not text.strip():
            continue
        where = "catalog %s line %d" % (path, n)
        try:
            item_id, absolute, key, caption = parse_line(text, folder, where)
        except ValueError as e:
            errors.append(str(e))
            continue
        item = by_path.get(absolute)
        if item is None:
            other = by_id.get(item_id)
            if other is not None:
                errors.append("%s: id %r already names %s (line %d)" % (where, item_id, other.path,
                                                                        other.line))
                continue
            item = by_path[absolute] = by_id[item_id] = Item(item_id, absolute, key, n)
            items.append(item)
        elif item.id != item_id:
            errors.append("%s: %s is item %r since line %d, not %r" % (where, absolute, item.id,
                                                                       item.line, item_id))
            continue
        if caption not in item.captions:
            item.captions.append(caption)
    if errors:
        more = len(errors) - MAX_REPORTED_ERRORS
        msg = "\n".join(errors[:MAX_REPORTED_ERRORS])
        if more > 0:
            msg += "\n... and %d more" % more
        raise CatalogError(msg)
    if len(items) < 2:
        raise CatalogError("catalog %s: %d item(s); train-adapter needs at least 2" % (
            path, len(items)))
    return items


def split(items, val_fraction, seed):
    """(train, held_out): round(val_fraction * N) items held out (at least one when the fraction
    is positive, never all), chosen by a seeded hash of each item's path as written in the
    catalog, so the split depends on neither the line order nor the catalog's location, and
    adding items moves few others. Each list keeps the catalog's order."""
    if not 0 <= val_fraction < 1:
        raise ValueError("--val-fraction must be in [0, 1), not %g" % val_fraction)
    n_held = min(len(items) - 1, round(val_fraction * len(items)))
    if val_fraction > 0:
        n_held = max(1, n_held)

    def rank(item):
        return hashlib.sha256(("%d\0%s" % (seed, item.key)).encode("utf-8")).digest()

    held = {id(it) for it in sorted(items, key=rank)[:n_held]}
    return ([it for it in items if id(it) not in held], [it for it in items if id(it) in held])


def held_out_files(items, out_dir):
    """Writes OUT_DIR/catalog.jsonl (absolute paths) and OUT_DIR/queries.jsonl (each caption a
    query; relevant: every held-out item with that caption), the input of moe-eval-recall.
    Returns the queries."""
    os.makedirs(out_dir, exist_ok=True)
    relevant = {}
    for it in items:
        for c in it.captions:
            relevant.setdefault(c, []).append(it.id)
    queries = [{"id": "q%d" % n, "text": c, "relevant": ids}
               for n, (c, ids) in enumerate(relevant.items())]
    with open(os.path.join(out_dir, "catalog.jsonl"), "w", encoding="utf-8") as fh:
        for it in items:
            fh.write(json.dumps({"id": it.id, "path": it.path, "caption": it.captions[0]},
                                ensure_ascii=False) + "\n")
    with open(os.path.join(out_dir, "queries.jsonl"), "w", encoding="utf-8") as fh:
        for q in queries:
            fh.write(json.dumps(q, ensure_ascii=False) + "\n")
    return queries
