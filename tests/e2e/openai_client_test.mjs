// The official OpenAI Node client against a Strata router: completions and chat, streaming and
// not. Run by cluster_e2e_test.py (which installs the `openai` npm package):
//   node openai_client_test.mjs BASE_URL
// Prints "openai client: ok" and exits 0, or prints what differed and exits 1.
import OpenAI from "openai";

const base = process.argv[2];
const client = new OpenAI({ baseURL: base + "/v1", apiKey: "unused", maxRetries: 0 });
const fail = (what) => {
  console.log("openai client: FAILED: " + what);
  process.exit(1);
};

const models = await client.models.list();
const model = models.data[0].id;
if (model !== "strata-tiny") fail("models.list gave " + JSON.stringify(models.data));

const prompt = "The lighthouse keeper wrote in his log that the storm";
const plain = await client.completions.create({ model, prompt, max_tokens: 8, temperature: 0 });
const text = plain.choices[0].text;
if (plain.usage.completion_tokens !== 8) fail("usage " + JSON.stringify(plain.usage));

let streamed = "";
const stream = await client.completions.create({
  model, prompt, max_tokens: 8, temperature: 0, stream: true,
});
for await (const chunk of stream) streamed += chunk.choices[0]?.text ?? "";
if (streamed !== text) fail(`streamed ${JSON.stringify(streamed)} != ${JSON.stringify(text)}`);

const messages = [{ role: "user", content: "When does the reading room open?" }];
const chat = await client.chat.completions.create({ model, messages, max_tokens: 6, temperature: 0 });
const reply = chat.choices[0].message.content;
if (chat.choices[0].message.role !== "assistant") fail("chat role");
let chatStreamed = "";
let usage = null;
const chatStream = await client.chat.completions.create({
  model, messages, max_tokens: 6, temperature: 0, stream: true,
  stream_options: { include_usage: true },
});
for await (const chunk of chatStream) {
  chatStreamed += chunk.choices[0]?.delta?.content ?? "";
  if (chunk.usage) usage = chunk.usage;
}
if (chatStreamed !== reply) fail(`chat streamed ${JSON.stringify(chatStreamed)} != ${JSON.stringify(reply)}`);
if (!usage || usage.completion_tokens !== 6) fail("chat usage " + JSON.stringify(usage));

// OpenAI's penalties and vLLM's repetition_penalty / min_p, streaming and not: the caller
// compares the text with single-process `strata generate` given the same values.
const penalties = { presence_penalty: 0.4, frequency_penalty: 0.6, repetition_penalty: 1.3 };
const penalized = await client.completions.create({
  model, prompt, max_tokens: 24, temperature: 0, ...penalties,
});
let penalizedStreamed = "";
const penalizedStream = await client.completions.create({
  model, prompt, max_tokens: 24, temperature: 0, stream: true, min_p: 0.1, ...penalties,
});
for await (const chunk of penalizedStream) penalizedStreamed += chunk.choices[0]?.text ?? "";
if (penalizedStreamed !== penalized.choices[0].text) {
  fail(`penalized streamed ${JSON.stringify(penalizedStreamed)} != ` +
       JSON.stringify(penalized.choices[0].text));
}
console.log("penalized: " + JSON.stringify(penalized.choices[0].text));

// Logprobs: chat's content entries and completions' arrays, streaming and not, the same.
const lpChat = await client.chat.completions.create({
  model, messages, max_tokens: 6, temperature: 0, logprobs: true, top_logprobs: 3,
});
const lpContent = lpChat.choices[0].logprobs?.content ?? [];
if (lpContent.length !== lpChat.usage.completion_tokens) {
  fail("chat logprobs " + JSON.stringify(lpChat.choices[0].logprobs));
}
for (const e of lpContent) {
  if (!(e.logprob <= 0) || e.top_logprobs.length !== 3 || e.top_logprobs[0].logprob !== e.logprob) {
    fail("chat logprob entry " + JSON.stringify(e));
  }
}
const lpChatStream = await client.chat.completions.create({
  model, messages, max_tokens: 6, temperature: 0, logprobs: true, top_logprobs: 3, stream: true,
});
const lpStreamed = [];
for await (const chunk of lpChatStream) lpStreamed.push(...(chunk.choices[0]?.logprobs?.content ?? []));
if (JSON.stringify(lpStreamed) !== JSON.stringify(lpContent)) {
  fail(`chat logprobs streamed ${JSON.stringify(lpStreamed)} != ${JSON.stringify(lpContent)}`);
}
const lpCompletion = await client.completions.create({
  model, prompt, max_tokens: 4, temperature: 0, logprobs: 2, echo: true,
});
const lpc = lpCompletion.choices[0];
if (!lpc.text.startsWith(prompt) || lpc.logprobs.token_logprobs[0] !== null ||
    lpc.logprobs.tokens.length !== lpCompletion.usage.prompt_tokens + 4) {
  fail("completions echo logprobs " + JSON.stringify(lpc));
}

try {
  await client.completions.create({ model: "no-such-model", prompt, max_tokens: 2 });
  fail("an unknown model was accepted");
} catch (e) {
  if (!(e instanceof OpenAI.NotFoundError)) fail("unknown model gave " + e);
}
console.log("openai client: ok");
