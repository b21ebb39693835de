#!/usr/bin/env bash
# Snapshots of other commits for an A/B benchmark in one device call: each ref's tree (git
# archive, no .git) lands in .ab/<name>/ with its commit in .ab/<name>/COMMIT. Pass `.ab` in the
# device call's carry; `gpu_run.sh ab` builds every tree there in place and runs the same bench
# on each beside the checked-out tree, then scripts/ab_table.py compares them.
# Usage: bash scripts/ab_trees.sh REF [REF ...]   (e.g. main decode-rows; none: clears .ab)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
rm -rf .ab
for ref in "$@"; do
  name=${ref//\//_}
  mkdir -p ".ab/$name"
  git archive "$ref" | tar -x -C ".ab/$name"
  git rev-parse --short "$ref" > ".ab/$name/COMMIT"
  echo ".ab/$name: $(cat ".ab/$name/COMMIT") ($(du -sh ".ab/$name" | cut -f1))"
done
