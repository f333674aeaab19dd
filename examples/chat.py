"""Chat with SmolLM2-135M-Instruct, keeping the conversation's K/V cache in a running kvstore daemon.

    kvstore serve &                                   # or ./dev serve
    python examples/chat.py                           # type questions; an empty line ends
    python examples/chat.py "Hi!" "Tell me more."     # or give them as arguments

Every turn reuses the blocks the previous turns stored, so only the new
message is computed. Start the script again under the same --session after
a daemon restart: the first turn comes back from nvme.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterator

from kvstore import KVStoreClient
from kvstore.integrations.chat import Conversation, run_turn
from kvstore.integrations.models import load_smollm2


def questions(given: list[str]) -> Iterator[str]:
    yield from given
    if given:
        return
    while line := input("you> ").strip():
        yield line


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("questions", nargs="*", help="the user's messages (default: read from stdin)")
    parser.add_argument(
        "--endpoint", help="daemon endpoint (default: $KVSTORE_ENDPOINT or the default socket)"
    )
    parser.add_argument("--session", default="example-chat")
    parser.add_argument("--max-new-tokens", type=int, default=96)
    args = parser.parse_args()

    llm = load_smollm2()
    chat = Conversation(llm.tokenizer)
    with KVStoreClient(args.endpoint, model=llm.model_id, layout=llm.layout(), timeout=30.0) as client:
        for text in questions(args.questions):
            turn = run_turn(
                llm.model, client, chat.ask(text), max_new_tokens=args.max_new_tokens, session=args.session
            )
            print(f"bot> {chat.answer(turn.output_ids).strip()}")
            print(
                f"     [{turn.reused_tokens}/{turn.prompt_tokens} prompt tokens from kvstore "
                f"({', '.join(sorted(set(turn.tiers))) or 'none'}), first token after {turn.ttft_s:.3f} s]"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
