// mirrorsd C# sample: ar, sd and Mirror-SD on a mirrorsd export folder through libmirrorsd (P/Invoke).
// Token ids in, token ids out (no tokenizer here). Compiles with Mono's mcs (C# 7) and with a .NET SDK:
//
//   mcs -out:mirrorsd-sample.exe Program.cs MirrorSD.cs && LD_LIBRARY_PATH=<folder of libmirrorsd.so> \
//       mono mirrorsd-sample.exe EXPORT_FOLDER [--mode ar|sd|mirror|all] [--max-new-tokens 32] [--gamma 4] \
//       [--kernels LIBMIRRORSD_KERN_SO] --ids 1 17 42
//   dotnet run -- EXPORT_FOLDER --ids 1 17 42          (same; libmirrorsd.so on LD_LIBRARY_PATH)
using System;
using System.Collections.Generic;
using System.Linq;

namespace MirrorSD
{
    public static class Program
    {
        static int Usage(string problem)
        {
            Console.Error.WriteLine("error: " + problem);
            Console.Error.WriteLine("usage: mirrorsd-sample EXPORT_FOLDER [--mode ar|sd|mirror|all] [--max-new-tokens N] " +
                                    "[--gamma N] [--threads N] [--kernels LIBMIRRORSD_KERN_SO] --ids ID [ID ...]");
            return 64;
        }

        public static int Main(string[] args)
        {
            if (args.Length < 1 || args[0].StartsWith("-")) return Usage("no export folder");
            string folder = args[0], only = "all", kernels = null;
            int maxNewTokens = 32, gamma = 4, threads = 0;
            var ids = new List<long>();
            for (int i = 1; i < args.Length; i++)
            {
                string flag = args[i];
                if (flag == "--ids")
                {
                    while (i + 1 < args.Length && !args[i + 1].StartsWith("-")) ids.Add(long.Parse(args[++i]));
                    continue;
                }
                if (i + 1 >= args.Length) return Usage(flag + " needs a value");
                string value = args[++i];
                if (flag == "--mode") only = value;
                else if (flag == "--max-new-tokens") maxNewTokens = int.Parse(value);
                else if (flag == "--gamma") gamma = int.Parse(value);
                else if (flag == "--threads") threads = int.Parse(value);
                else if (flag == "--kernels") kernels = value;
                else return Usage("unknown option " + flag);
            }
            try
            {
                return Run(folder, only, maxNewTokens, gamma, threads, kernels, ids.ToArray());
            }
            catch (MirrorSDException e)
            {
                Console.Error.WriteLine("error: " + e.Message);
                return e.Status;
            }
        }

        static int Run(string folder, string only, int maxNewTokens, int gamma, int threads, string kernels,
                       long[] ids)
        {
            var outputs = new Dictionary<string, List<long>>();
            using (var model = new Model(folder, null, null, threads, kernels))
            {
                Console.WriteLine("# " + folder + ": target " + model.Info.TargetProvider + ", draft " +
                                  model.Info.DraftProvider + ", vocab " + model.Info.VocabSize +
                                  ", MatMulNBits kernels " + model.Info.TargetKernels + "/" + model.Info.DraftKernels);
                foreach (Mode mode in new[] { Mode.Ar, Mode.Sd, Mode.Mirror })
                {
                    string name = mode.ToString().ToLowerInvariant();
                    if (only != "all" && only != name) continue;
                    GenerateConfig config = Model.DefaultConfig();
                    config.Mode = (int)mode;
                    config.MaxNewTokens = maxNewTokens;
                    config.Gamma = gamma;
                    Stats stats;
                    outputs[name] = model.Generate(ids, config, out stats);
                    Console.WriteLine(name + ": " + string.Join(" ", outputs[name]));
                    Console.WriteLine(string.Format(System.Globalization.CultureInfo.InvariantCulture,
                        "{0} stats: {1} tokens, {2:F1} tok/s, mean accepted {3:F2}, reuse {4:F2}", name,
                        stats.NewTokens, stats.TokensPerSecond, stats.MeanAcceptedTokens, stats.ReuseRate));
                }
            }
            if (only == "all")
            {
                foreach (string name in new[] { "sd", "mirror" })
                    Console.WriteLine(name + " identical to ar: " +
                                      (outputs[name].SequenceEqual(outputs["ar"]) ? "yes" : "no"));
            }
            return 0;
        }
    }
}
