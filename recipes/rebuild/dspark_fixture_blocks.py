"""Save the trained DSpark fixture's drafts per block as the authors' code makes them (tests/fixtures/families/
dspark_blocks.npz): each slot's most likely ids, its base and Markov-corrected logits there, the greedy drafts,
at six anchors of the toy target's greedy reply to its first prompt. tests/test_family_fixtures.py checks ours
against them. DeepSpec (github.com/deepseek-ai/DeepSpec) is not on the package index: pass a checkout.

    python recipes/rebuild/dspark_fixture_blocks.py --deepspec <checkout of deepseek-ai/DeepSpec>
"""

import argparse
import sys
from pathlib import Path

import numpy as np


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--deepspec", required=True, help="a checkout of deepseek-ai/DeepSpec")
    args = parser.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))
    from helpers import dspark_fixture

    blocks = dspark_fixture.authors_blocks(args.deepspec)
    np.savez_compressed(dspark_fixture.SAVED, **blocks)
    print(f"wrote {dspark_fixture.SAVED}: {', '.join(f'{k} {v.shape}' for k, v in blocks.items())}")


if __name__ == "__main__":
    main()
