// The JS OpenAI Agents SDK (@openai/agents) against the service, two turns, as its users write them.
//
// The second turn sends the first one's history back, as the SDK builds it (on Chat Completions: the
// assistant message's own members echoed inside its text part). Driven by tests/test_js_agents.py:
//   LMSP_BASE_URL, LMSP_TOKEN, LMSP_MODEL, LMSP_API ("chat" or "responses"), LMSP_MAX_TOKENS
// It prints one JSON line: each turn's final output and the id of the model response it came from.
import { Agent, OpenAIChatCompletionsModel, OpenAIResponsesModel, run, setTracingDisabled } from '@openai/agents';
import OpenAI from 'openai';

// The SDK would send its traces to OpenAI: nothing here may leave the machine.
setTracingDisabled(true);

const env = process.env;
const client = new OpenAI({ baseURL: env.LMSP_BASE_URL, apiKey: env.LMSP_TOKEN, maxRetries: 0, timeout: 60_000 });
const model =
  env.LMSP_API === 'responses'
    ? new OpenAIResponsesModel(client, env.LMSP_MODEL)
    : new OpenAIChatCompletionsModel(client, env.LMSP_MODEL);
const agent = new Agent({
  name: 'assistant',
  instructions: 'Be brief.',
  model,
  modelSettings: { maxTokens: Number(env.LMSP_MAX_TOKENS || 2000) },
});

const first = await run(agent, 'Hello');
const second = await run(agent, [...first.history, { role: 'user', content: 'And then?' }]);
const turns = [first, second].map((result) => ({
  output: result.finalOutput,
  response_id: result.rawResponses.at(-1)?.responseId ?? null,
}));
process.stdout.write(JSON.stringify({ turns, history: second.history }) + '\n');
