#!/usr/bin/env python3
"""Check the links of README.md and docs/*.md (tests/docs/check-links.sh runs it).

Fails (exit 1, one line per problem) when
  - a relative link or image, [text](path) or [text](path#anchor), points
    at a file or folder that does not exist;
  - an anchor (#anchor, or path.md#anchor) names no heading of the target
    page (GitHub's rules: lower case, punctuation dropped, spaces to
    hyphens, -1, -2 ... for repeated headings);
  - a path written in backticks in the prose, such as
    `agent/transport/tcp/tcp_serve.c`, does not exist.  A backticked word
    counts as a path when it starts with one of the repository's top-level
    folders; words with a glob (*) must match something; words with a
    placeholder in capitals (tests/fuzz/corpus/NAME/) are not checked.

Links to other sites (http:, https:, mailto:) are not fetched.  Fenced code
blocks are skipped: they hold commands and code, not links.

Usage: check_links.py [ROOT]   (default: the repository holding this file)
"""
import glob
import os
import re
import sys

ROOT = os.path.abspath(sys.argv[1] if len(sys.argv) > 1 else
                       os.path.join(os.path.dirname(__file__), "..", ".."))
PATH_PREFIXES = ("agent/", "meta/", "include/", "proto/", "tests/", "deploy/", "docs/",
                 ".ci/")
TOP_FILES = ("Makefile", "README.md")
LINK = re.compile(r"!?\[(?:[^\]\[]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
CODE_SPAN = re.compile(r"(`+)(.+?)\1")
PLACEHOLDER = re.compile(r"^[A-Z][A-Z0-9_]*$")
PATH_WORD = re.compile(r"^[A-Za-z0-9_.@+*/-]+$")


def pages():
    out = [os.path.join(ROOT, "README.md")]
    out += sorted(glob.glob(os.path.join(ROOT, "docs", "*.md")))
    return [p for p in out if os.path.isfile(p)]


def prose_lines(path):
    """(line number, text) of the lines outside fenced code blocks."""
    fence = None
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            m = re.match(r"^\s*(```+|~~~+)", line)
            if m:
                if fence is None:
                    fence = m.group(1)[0] * 3
                elif m.group(1).startswith(fence):
                    fence = None
                continue
            if fence is None:
                yield n, line.rstrip("\n")


def slug(text):
    """A heading's anchor as GitHub makes it."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", text)  # links: their text
    text = text.replace("`", "").strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


_anchors = {}


def anchors(path):
    if path not in _anchors:
        seen, out = {}, set()
        for _, line in prose_lines(path):
            m = re.match(r"^(#{1,6})\s+(.*?)\s*#*\s*$", line)
            if not m:
                continue
            s = slug(m.group(2))
            k = seen.get(s, 0)
            seen[s] = k + 1
            out.add(s if k == 0 else "%s-%d" % (s, k))
        _anchors[path] = out
    return _anchors[path]


def check_link(page, n, target, errors):
    if re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*:", target):
        return  # http:, https:, mailto: ...
    path, _, anchor = target.partition("#")
    dest = page if path == "" else os.path.normpath(os.path.join(os.path.dirname(page), path))
    where = "%s:%d" % (os.path.relpath(page, ROOT), n)
    if not os.path.exists(dest):
        errors.append("%s: link to a missing file: %s" % (where, target))
        return
    if anchor:
        if not dest.endswith(".md") or os.path.isdir(dest):
            errors.append("%s: anchor on a page that is not Markdown: %s" % (where, target))
        elif anchor not in anchors(dest):
            errors.append("%s: no heading '#%s' in %s" %
                          (where, anchor, os.path.relpath(dest, ROOT)))


def check_path_word(page, n, word, errors):
    word = word.strip()
    if not (word.startswith(PATH_PREFIXES) or word in TOP_FILES):
        return
    if not PATH_WORD.match(word) or "//" in word:
        return
    if any(PLACEHOLDER.match(part) for part in word.split("/")):
        return
    where = "%s:%d" % (os.path.relpath(page, ROOT), n)
    full = os.path.join(ROOT, word)
    if "*" in word:
        if not glob.glob(full):
            errors.append("%s: `%s` matches no file" % (where, word))
    elif not os.path.exists(full):
        errors.append("%s: `%s` does not exist" % (where, word))


def main():
    errors, links, words = [], 0, 0
    checked = pages()
    for page in checked:
        for n, line in prose_lines(page):
            for m in CODE_SPAN.finditer(line):
                words += 1
                check_path_word(page, n, m.group(2), errors)
            for m in LINK.finditer(CODE_SPAN.sub("", line)):
                links += 1
                check_link(page, n, m.group(1), errors)
    for e in errors:
        print(e)
    print("%d pages, %d links, %d code spans checked; %d problems" %
          (len(checked), links, words, len(errors)))
    return 1 if errors or not checked else 0


if __name__ == "__main__":
    sys.exit(main())
