// The official openai npm package against a chatserve URL (argv[2]); prints one JSON object of results.
import OpenAI from "openai";

const client = new OpenAI({ baseURL: process.argv[2] + "/v1", apiKey: process.argv[3] || "none", maxRetries: 0 });
const messages = [{ role: "user", content: "abc" }];
const out = {};

const model = await client.models.retrieve("fake-model");
out.model = model.id;

const chat = await client.chat.completions.create({ model: "fake-model", messages, max_tokens: 4 });
out.chat = chat.choices[0].message.content;

const stream = await client.chat.completions.create({
  model: "fake-model", messages, max_tokens: 4, stream: true, stream_options: { include_usage: true },
});
out.chunks = [];
out.usage = null;
for await (const c of stream) {
  if (c.usage) out.usage = c.usage.completion_tokens;
  for (const ch of c.choices) out.chunks.push({ role: ch.delta.role ?? null, content: ch.delta.content ?? null });
}

const cstream = await client.completions.create({ model: "fake-model", prompt: "abc", max_tokens: 4, stream: true });
out.completion = "";
for await (const c of cstream) for (const ch of c.choices) out.completion += ch.text;

console.log(JSON.stringify(out));
