#!/usr/bin/env python3
"""A stand-in for vLLM to try the endpoint picker without a GPU (docs/epp.md, "Ten-minute
setup"). Python standard library only.

    python3 demo_engine.py model MODELS_DIR
        writes the demo model `demo/words` into MODELS_DIR (the layout of the server's
        --tokenizer-models-dir): a word-level tokenizer.json whose word `wK` is token id
        K + 6, and a ChatML chat template in tokenizer_config.json. Consecutive words are
        consecutive token ids, which is what `inferencecache-fake-engine --start-token`
        publishes as cached blocks.

    python3 demo_engine.py serve --port 8000 --name e0
        an OpenAI-compatible engine on 127.0.0.1:PORT: POST /v1/chat/completions and
        /v1/completions answer at once (streamed as SSE when the body says "stream": true),
        with the `x-engine: NAME` response header and the request's
        `x-gateway-destination-endpoint` echoed in the answer's `routed_by` field; GET /metrics
        serves vLLM's load gauges (an idle engine), which the sidecar's --engine-metrics-url
        scrapes: without them the sidecar reports no stats, hence no endpoint.
"""

import argparse
import json
import os
import sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

MODEL = "demo/words"
SPECIAL = ["[UNK]", "<|im_start|>", "<|im_end|>", "system", "user", "assistant"]
WORDS = 8192
CHATML = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def write_model(models_dir):
    directory = os.path.join(models_dir, *MODEL.split("/"))
    os.makedirs(directory, exist_ok=True)
    vocab = {word: i for i, word in enumerate(SPECIAL)}
    vocab.update({f"w{k}": len(SPECIAL) + k for k in range(WORDS)})
    added = [
        {
            "id": vocab[token],
            "content": token,
            "single_word": False,
            "lstrip": False,
            "rstrip": False,
            "normalized": False,
            "special": True,
        }
        for token in ("<|im_start|>", "<|im_end|>")
    ]
    tokenizer = {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": added,
        "normalizer": None,
        "pre_tokenizer": {"type": "WhitespaceSplit"},
        "post_processor": None,
        "decoder": None,
        "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "[UNK]"},
    }
    with open(os.path.join(directory, "tokenizer.json"), "w") as f:
        json.dump(tokenizer, f)
    with open(os.path.join(directory, "tokenizer_config.json"), "w") as f:
        json.dump({"chat_template": CHATML, "eos_token": "<|im_end|>"}, f)
    print(f"wrote {directory}/tokenizer.json and tokenizer_config.json")


class Engine(BaseHTTPRequestHandler):
    name = "engine"
    protocol_version = "HTTP/1.1"

    def log_message(self, *args):
        pass

    def _send(self, status, body, content_type):
        self.send_response(status)
        self.send_header("content-type", content_type)
        self.send_header("content-length", str(len(body)))
        self.send_header("x-engine", self.name)
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self):
        if self.path.split("?")[0] == "/metrics":
            lines = [
                "# TYPE vllm:num_requests_running gauge",
                f'vllm:num_requests_running{{model_name="{MODEL}"}} 0',
                "# TYPE vllm:num_requests_waiting gauge",
                f'vllm:num_requests_waiting{{model_name="{MODEL}"}} 0',
                "# TYPE vllm:kv_cache_usage_perc gauge",
                f'vllm:kv_cache_usage_perc{{model_name="{MODEL}"}} 0.1',
            ]
            self._send(200, ("\n".join(lines) + "\n").encode(), "text/plain; version=0.0.4")
        else:
            self._send(404, b'{"error":"not found"}', "application/json")

    def do_POST(self):
        length = int(self.headers.get("content-length") or 0)
        raw = self.rfile.read(length)
        try:
            request = json.loads(raw or b"{}")
        except ValueError:
            self._send(400, b'{"error":"body is not JSON"}', "application/json")
            return
        routed_by = self.headers.get("x-gateway-destination-endpoint")
        text = f"answered by {self.name}"
        if request.get("stream") is True:
            self.send_response(200)
            self.send_header("content-type", "text/event-stream")
            self.send_header("transfer-encoding", "chunked")
            self.send_header("x-engine", self.name)
            self.end_headers()
            for word in text.split() + ["[DONE]"]:
                event = {"choices": [{"index": 0, "delta": {"content": word + " "}}]}
                data = "[DONE]" if word == "[DONE]" else json.dumps(event)
                chunk = f"data: {data}\n\n".encode()
                self.wfile.write(f"{len(chunk):x}\r\n".encode() + chunk + b"\r\n")
            self.wfile.write(b"0\r\n\r\n")
            return
        answer = {
            "object": "chat.completion",
            "model": request.get("model", MODEL),
            "engine": self.name,
            "routed_by": routed_by,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text}}],
        }
        self._send(200, json.dumps(answer).encode() + b"\n", "application/json")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    model = sub.add_parser("model", help="write the demo tokenizer into MODELS_DIR")
    model.add_argument("models_dir")
    serve = sub.add_parser("serve", help="serve an OpenAI-compatible stand-in engine")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--name", default="engine")
    args = parser.parse_args()
    if args.command == "model":
        write_model(args.models_dir)
        return
    Engine.name = args.name
    server = ThreadingHTTPServer((args.host, args.port), Engine)
    print(f"{args.name} serving on {args.host}:{args.port}", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    sys.exit(main())
