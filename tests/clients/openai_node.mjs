// The official OpenAI Node SDK against the gateway: plain, streamed, tool calls, an error.
// Usage: node openai_node.mjs BASE_URL API_KEY chat|tools; prints one JSON object.
import OpenAI from "openai";

const [base, apiKey, mode] = process.argv.slice(2);
const client = new OpenAI({ baseURL: `${base}/v1`, apiKey, maxRetries: 0 });
const out = {};

if (mode === "chat") {
  const messages = [{ role: "user", content: "Hello from Node" }];
  const plain = await client.chat.completions.create({ model: "m", messages, max_tokens: 8, temperature: 0 });
  out.plain = { id: plain.id, content: plain.choices[0].message.content, fingerprint: plain.system_fingerprint,
                usage: plain.usage, finish: plain.choices[0].finish_reason };
  const stream = await client.chat.completions.create({
    model: "m", messages, max_tokens: 8, temperature: 0, stream: true, stream_options: { include_usage: true } });
  out.stream = { text: "", chunks: 0, usage: null, finish: null };
  for await (const chunk of stream) {
    out.stream.chunks += 1;
    if (chunk.usage) out.stream.usage = chunk.usage;
    for (const choice of chunk.choices) {
      out.stream.text += choice.delta?.content ?? "";
      if (choice.finish_reason) out.stream.finish = choice.finish_reason;
    }
  }
  try {
    await client.chat.completions.create({ model: "m", messages: [], max_tokens: 4 });
  } catch (error) {
    out.error = { status: error.status, type: error.type, param: error.param, message: error.message };
  }
} else {
  const tools = [{ type: "function", function: { name: "get_weather", description: "Weather for a city.",
    parameters: { type: "object", properties: { city: { type: "string" } }, required: ["city"] } } }];
  const messages = [{ role: "user", content: "Weather in Paris?" }];
  const first = await client.chat.completions.create({ model: "m", messages, tools, max_tokens: 64 });
  const call = first.choices[0].message.tool_calls[0];
  out.call = { finish: first.choices[0].finish_reason, name: call.function.name, args: JSON.parse(call.function.arguments) };
  messages.push(first.choices[0].message, { role: "tool", tool_call_id: call.id, content: "18 C" });
  const runner = client.chat.completions.stream({ model: "m", messages, tools, max_tokens: 64 });
  const final = await runner.finalChatCompletion();
  out.streamed_call = final.choices[0].message.tool_calls.map((c) => c.function.name);
}
console.log(JSON.stringify(out));
