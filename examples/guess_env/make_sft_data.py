"""SFT rows for the guess env from scripted games (binary search), one JSON line per game: sft.dataset's format."""
import json
import sys

from guess_env.env import CORRECT, HIGHER, LOWER, START, GuessNumber

env = GuessNumber()
p, pieces = env.params, env.message_spec(env.params).slots[0].pieces
with open(sys.argv[1] if len(sys.argv) > 1 else "guess_sft.jsonl", "w") as f:
    for secret in range(1, p.max_number + 1):  # one game per secret
        low, high, completion = 1, p.max_number, []
        while True:
            guess = (low + high) // 2
            status = CORRECT if guess == secret else HIGHER if guess < secret else LOWER
            completion += [{"role": "assistant", "content": f"<guess>{guess}</guess>"},
                           {"role": "user", "content": pieces[status]}]
            if status == CORRECT:
                break
            low, high = (guess + 1, high) if status == HIGHER else (low, guess - 1)
        prompt = [{"role": "system", "content": env.system_prompt(p)}, {"role": "user", "content": pieces[START]}]
        f.write(json.dumps({"prompt": prompt, "completion": completion, "info": {"secret": secret}}) + "\n")
