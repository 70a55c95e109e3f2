// mirrorsd C# sample: greedy, streamed generation on a mirrorsd export folder through onnxruntime-genai.
// onnxruntime-genai reads the folder's genai_config.json (a "decoder-pipeline": prefix.onnx -> suffix.onnx) and its
// tokenizer/ folder; it decodes target-only (no draft, no Mirror-SD). Not built or run on the machine that wrote it
// (no .NET SDK there); see ../README.md.
//
//   dotnet run -- EXPORT_FOLDER ["prompt"] [max_new_tokens]
using System.Diagnostics;
using System.Text.Json;
using Microsoft.ML.OnnxRuntimeGenAI;

if (args.Length < 1)
{
    Console.Error.WriteLine("usage: dotnet run -- EXPORT_FOLDER [\"prompt\"] [max_new_tokens]");
    return 2;
}
string folder = args[0];
string prompt = args.Length > 1 ? args[1] : "Why is the sky blue?";
int maxNewTokens = args.Length > 2 ? int.Parse(args[2]) : 128;

using var model = new Model(folder);
using var tokenizer = new Tokenizer(model);

// The chat template comes from the export's tokenizer folder (null = the model's own template).
string messages = JsonSerializer.Serialize(new[] { new { role = "user", content = prompt } });
string rendered = tokenizer.ApplyChatTemplate(null, messages, null, true);
using var sequences = tokenizer.Encode(rendered);
int promptTokens = sequences[0].Length;

using var generatorParams = new GeneratorParams(model);
generatorParams.SetSearchOption("max_length", promptTokens + maxNewTokens);
generatorParams.SetSearchOption("do_sample", false);  // greedy: the same tokens as `mirrorsd generate --mode ar`

using var generator = new Generator(model, generatorParams);
using var stream = tokenizer.CreateStream();
var watch = Stopwatch.StartNew();
generator.AppendTokenSequences(sequences);
int produced = 0;
while (!generator.IsDone())
{
    generator.GenerateNextToken();
    Console.Write(stream.Decode(generator.GetNextTokens()[0]));
    produced++;
}
watch.Stop();
Console.WriteLine();
Console.Error.WriteLine($"{produced} tokens in {watch.Elapsed.TotalSeconds:F2} s " +
                        $"({produced / Math.Max(watch.Elapsed.TotalSeconds, 1e-9):F1} tok/s), prompt {promptTokens} tokens");
return 0;
